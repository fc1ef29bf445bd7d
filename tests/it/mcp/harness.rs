//! `toolgate mcp` and `/mcp` as agent harnesses use them (issue 43), driven
//! with raw JSON-RPC (what a harness's own client sends, malformed lines
//! included) over a child's stdio and over streamable HTTP, against a slow
//! provider (`toolgate provider serve --faults latency(..)`) or a demo
//! ledger's `Toolgate-Fault` header.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::HttpFixture;

/// A `toolgate mcp` child spoken to line by line; killed on drop.
pub(crate) struct Raw {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Messages read while waiting for another id.
    stash: Vec<Value>,
}

impl Raw {
    pub(crate) fn start(db: &Path, catalog: Option<&Path>, token: &str, extra: &[&str]) -> Self {
        let mut cmd = Command::new(assert_cmd::cargo::cargo_bin("toolgate"));
        cmd.arg("--db").arg(db);
        if let Some(c) = catalog {
            cmd.arg("--catalog").arg(c);
        }
        let mut child = cmd
            .args(["mcp", "--token", token])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { stdin: child.stdin.take(), child, lines, stash: Vec::new() }
    }

    pub(crate) fn send_line(&mut self, line: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    pub(crate) fn send(&mut self, v: &Value) {
        self.send_line(v.to_string().as_bytes());
    }

    /// The next message the server writes, or `None` after `within`.
    fn next(&mut self, within: Duration) -> Option<Value> {
        let line = self.lines.recv_timeout(within).ok()?;
        Some(
            serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("the server wrote a line that is not JSON ({e}): {line}")),
        )
    }

    /// The response to request `id`, or `None` after `within`.
    pub(crate) fn try_answer(&mut self, id: &Value, within: Duration) -> Option<Value> {
        if let Some(i) = self.stash.iter().position(|m| m.get("id") == Some(id) && m.get("method").is_none()) {
            return Some(self.stash.remove(i));
        }
        let end = Instant::now() + within;
        loop {
            let left = end.checked_duration_since(Instant::now())?;
            let m = self.next(left)?;
            if m.get("id") == Some(id) && m.get("method").is_none() {
                return Some(m);
            }
            self.stash.push(m);
        }
    }

    pub(crate) fn answer(&mut self, id: &Value, within: Duration) -> Value {
        self.try_answer(id, within).unwrap_or_else(|| panic!("no answer to id {id} within {within:?}"))
    }

    pub(crate) fn initialize(&mut self) -> Value {
        self.send(&json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}));
        let a = self.answer(&json!("init"), Duration::from_secs(10));
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        a
    }
}

impl Raw {
    /// Sends SIGTERM.
    pub(crate) fn terminate(&self) {
        let ok = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(ok.success());
    }

    /// Closes standard input (what a harness does first when it stops a server).
    pub(crate) fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits (bounded) for the child to exit.
    pub(crate) fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn tools_call(id: &Value, tool: &str, args: &Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": args}})
}

pub(crate) fn refund(order: &str, amount: i64, key: &str) -> Value {
    json!({"order_ref": order, "amount_minor": amount, "currency": "EUR", "reason": "damaged", "idempotency_key": key})
}

/// A call's model result (structured content), checked to be the text the model reads too.
pub(crate) fn model(answer: &Value) -> Value {
    let r = &answer["result"];
    let structured = r["structuredContent"].clone();
    assert!(structured.is_object(), "a tool result with structured content: {answer}");
    let text = r["content"][0]["text"].as_str().unwrap_or_else(|| panic!("a text block: {answer}"));
    assert_eq!(serde_json::from_str::<Value>(text).unwrap(), structured, "the text is the model result");
    structured
}

/// Each tool's advertised `outputSchema`, compiled (§5).
pub(crate) struct Schemas(std::collections::HashMap<String, jsonschema::Validator>);

impl Schemas {
    /// From a `tools/list` answer; every tool must advertise one.
    pub(crate) fn of(list: &Value) -> Self {
        let tools = list["result"]["tools"].as_array().unwrap_or_else(|| panic!("a tools/list answer: {list}"));
        Self(
            tools
                .iter()
                .map(|t| {
                    let name = t["name"].as_str().unwrap().to_string();
                    let schema = t.get("outputSchema").unwrap_or_else(|| panic!("{name} advertises no outputSchema"));
                    (name, jsonschema::validator_for(schema).unwrap())
                })
                .collect(),
        )
    }

    /// The model result of `answer` (a `tools/call` of `tool`), checked against the tool's outputSchema.
    pub(crate) fn model(&self, tool: &str, answer: &Value) -> Value {
        let m = model(answer);
        let v = self.0.get(tool).unwrap_or_else(|| panic!("no tool {tool}"));
        let errors: Vec<String> = v.iter_errors(&m).map(|e| format!("{} at {}", e, e.instance_path())).collect();
        assert!(errors.is_empty(), "{tool}: structuredContent breaks its outputSchema: {errors:?}\n{m:#}");
        m
    }
}

impl Raw {
    pub(crate) fn schemas(&mut self) -> Schemas {
        self.send(&json!({"jsonrpc": "2.0", "id": "list", "method": "tools/list"}));
        Schemas::of(&self.answer(&json!("list"), Duration::from_secs(10)))
    }
}

/// §5 over stdio: every tool advertises an outputSchema, and the structured
/// content of each kind of result (success, replay, conflicts, refusals,
/// reads, the status query, the server's own SERVER_BUSY) matches it.
#[test]
fn structured_content_matches_the_advertised_output_schema_over_stdio() {
    let f = crate::support::Fixture::on(crate::support::Backend::Sqlite);
    let created =
        super::toolgate(f.path(), &["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"]);
    let mut c = Raw::start(f.path(), None, created["token"].as_str().unwrap(), &["--concurrency", "1"]);
    c.initialize();
    let schemas = c.schemas();
    let mut id = 100;
    let mut call = |c: &mut Raw, tool: &str, args: Value| {
        id += 1;
        c.send(&tools_call(&json!(id), tool, &args));
        schemas.model(tool, &c.answer(&json!(id), Duration::from_secs(10)))
    };
    let ok = call(&mut c, "create_refund", refund("ord_1001", 1000, "mcp43-schema-0001"));
    assert_eq!(ok["status"], "succeeded", "{ok}");
    let codes = [
        ("create_refund", refund("ord_1001", 1000, "mcp43-schema-0001"), None),
        ("create_refund", refund("ord_1001", 1200, "mcp43-schema-0001"), Some("IDEMPOTENCY_CONFLICT")),
        (
            "create_refund",
            json!({"order_ref": "ord_1001", "amount_minor": 5, "currency": "EUR", "reason": "damaged"}),
            Some("IDEMPOTENCY_KEY_REQUIRED"),
        ),
        ("create_refund", refund("ord_1001", -5, "mcp43-schema-0002"), Some("INVALID_ARGUMENTS")),
        ("create_refund", refund("ord_1003", 5, "mcp43-schema-0003"), Some("BUSINESS_RULE_VIOLATION")),
        ("get_order", json!({"order_ref": "ord_1001"}), None),
        ("get_order", json!({"order_ref": "ord_9999"}), Some("NOT_FOUND")),
        (
            "query_operation_status",
            json!({"status_ref": "sr1_forged", "expected_request_sha256": "0".repeat(64)}),
            Some(""),
        ),
    ];
    for (tool, args, code) in codes {
        let m = call(&mut c, tool, args);
        match code {
            None => assert_eq!(m["status"], "succeeded", "{tool}: {m}"),
            Some("") => assert!(m["error"]["code"].is_string(), "{tool}: {m}"),
            Some(code) => assert_eq!(m["error"]["code"], code, "{tool}: {m}"),
        }
    }
}

/// A ledger whose tools run behind a provider that answers each request
/// after `latency_ms` (attempt timeout 10 s), and an agent's token.
pub(crate) struct Slow {
    pub(crate) fx: HttpFixture,
    pub(crate) token: String,
}

impl Slow {
    pub(crate) fn new(latency_ms: u64, requests: usize) -> Self {
        Self::with_faults(&vec![format!("latency({latency_ms})"); requests].join(","))
    }

    /// The provider answers its requests as `faults` says, one fault each, in order.
    pub(crate) fn with_faults(faults: &str) -> Self {
        let fx = HttpFixture::with(&["--faults", faults], None);
        for entry in std::fs::read_dir(&fx.catalog).unwrap() {
            let path = entry.unwrap().path();
            let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            if v["retry"].is_object() {
                v["retry"]["attempt_timeout_ms"] = Value::from(10_000);
            }
            std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        }
        let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(&fx.ledger)
            .arg("--catalog")
            .arg(&fx.catalog)
            .args(["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let token = serde_json::from_slice::<Value>(&out.stdout).unwrap()["token"].as_str().unwrap().to_string();
        Self { fx, token }
    }

    pub(crate) fn mcp(&self, extra: &[&str]) -> Raw {
        let mut c = Raw::start(&self.fx.ledger, Some(&self.fx.catalog), &self.token, extra);
        c.initialize();
        c
    }

    /// (state, code) of the operation of `key`, if there is one.
    pub(crate) fn op(&self, key: &str) -> Option<(String, Option<String>)> {
        let c = rusqlite::Connection::open(&self.fx.ledger).unwrap();
        c.busy_timeout(Duration::from_secs(10)).unwrap();
        c.query_row("SELECT state, code FROM operations WHERE idem_key = ?1", [key], |r| Ok((r.get(0)?, r.get(1)?)))
            .ok()
    }

    /// Operator-log rows: (actor, action, result) of the operation of `key`.
    pub(crate) fn audit(&self, key: &str) -> Vec<(String, String, String)> {
        let c = rusqlite::Connection::open(&self.fx.ledger).unwrap();
        c.busy_timeout(Duration::from_secs(10)).unwrap();
        let mut st = c
            .prepare(
                "SELECT a.actor, a.action, a.result FROM audit_log a JOIN operations o ON o.id = a.operation_id \
                 WHERE o.idem_key = ?1 ORDER BY a.seq",
            )
            .unwrap();
        st.query_map([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect()
    }
}

/// Waits (bounded) until `f` holds; how long it took.
pub(crate) fn within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

/// §1: six calls in one session that runs two at a time against a provider
/// that takes 3 s each, then `notifications/cancelled` for the sixth (still
/// queued) at 0.5 s: the cancellation acts at once (not after the calls
/// ahead of it), the sixth ends `CANCELLED` with no effect and the operator
/// log names the client; the five others succeed, five effects.
#[test]
fn a_cancel_of_a_queued_call_wins_at_once_over_stdio() {
    let slow = Slow::new(3000, 8);
    let mut c = slow.mcp(&["--concurrency", "2"]);
    let key = |i: i64| format!("mcp43-cancel-{i:04}");
    for i in 1..=6 {
        c.send(&tools_call(&json!(i), "create_refund", &refund("ord_1002", 100 + i, &key(i))));
    }
    std::thread::sleep(Duration::from_millis(500));
    c.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 6, "reason": "the user gave up"}}));
    let took = within(Duration::from_secs(3), "the sixth call cancelled", || {
        slow.op(&key(6)) == Some(("failed".into(), Some("CANCELLED".into())))
    });
    eprintln!("cancel of a queued call applied {took:?} after the notification");
    for i in 1..=5 {
        let m = model(&c.answer(&json!(i), Duration::from_secs(20)));
        assert_eq!(m["status"], "succeeded", "call {i}: {m}");
    }
    assert_eq!(
        slow.op(&key(6)),
        Some(("failed".into(), Some("CANCELLED".into()))),
        "still cancelled after the queue drained"
    );
    let log = slow.audit(&key(6));
    assert!(log.contains(&("mcp-client".into(), "cancel".into(), "applied".into())), "{log:?}");
    assert_eq!(slow.fx.server.effects(), 5, "no effect for the cancelled call");
    assert_eq!(slow.fx.server.duplicates(), 0);
}

/// §1: the queue is bounded: one engine, one waiting call, the third is
/// `SERVER_BUSY` at once.
#[test]
fn a_full_session_queue_is_server_busy_over_stdio() {
    let slow = Slow::new(4000, 4);
    let mut c = slow.mcp(&["--concurrency", "1", "--queue", "1"]);
    let schemas = c.schemas();
    c.send(&tools_call(&json!(1), "create_refund", &refund("ord_1002", 101, "mcp43-busy-0001")));
    // The first call runs (its operation exists) before the second takes the queue's one place.
    within(Duration::from_secs(10), "the first call running", || slow.op("mcp43-busy-0001").is_some());
    c.send(&tools_call(&json!(2), "create_refund", &refund("ord_1002", 102, "mcp43-busy-0002")));
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    c.send(&tools_call(&json!(3), "create_refund", &refund("ord_1002", 103, "mcp43-busy-0003")));
    // Bounds for a loaded machine: refused at once, long before the 4 s call ends.
    let busy = schemas.model("create_refund", &c.answer(&json!(3), Duration::from_secs(10)));
    assert!(t.elapsed() < Duration::from_millis(3_500), "{:?}", t.elapsed());
    assert_eq!(busy["error"]["code"], "SERVER_BUSY", "{busy}");
    for i in 1..=2 {
        assert_eq!(model(&c.answer(&json!(i), Duration::from_secs(10)))["status"], "succeeded");
    }
}

/// §2: the same key while its first call runs: `IN_PROGRESS` at once, with
/// a retry-after and the status reference in the text the model reads and
/// in `_meta`; the first call then succeeds, one effect.
#[test]
fn a_key_in_flight_elsewhere_is_in_progress_over_stdio() {
    let slow = Slow::new(5000, 4);
    let mut c = slow.mcp(&["--concurrency", "2"]);
    let schemas = c.schemas();
    let args = refund("ord_1002", 700, "mcp43-inprogress-01");
    c.send(&tools_call(&json!(1), "create_refund", &args));
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    c.send(&tools_call(&json!(2), "create_refund", &args));
    let second = c.answer(&json!(2), Duration::from_secs(3));
    assert!(t.elapsed() < Duration::from_secs(3), "answered at once, not after the first call");
    let m = schemas.model("create_refund", &second);
    assert_eq!(m["status"], "unknown", "{m}");
    assert_eq!(m["error"]["code"], "IN_PROGRESS", "{m}");
    assert_eq!(m["error"]["recovery"], "retry_after", "{m}");
    assert!(m["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{m}");
    let status_ref = m["error"]["detail"]["status_ref"].as_str().expect("the status reference for the model");
    assert!(status_ref.starts_with("sr1_"), "{m}");
    assert_eq!(second["result"]["_meta"]["toolgate/status_ref"], status_ref, "{second}");
    assert_eq!(second["result"]["isError"], true);
    let first = schemas.model("create_refund", &c.answer(&json!(1), Duration::from_secs(10)));
    assert_eq!(first["status"], "succeeded", "{first}");
    assert_eq!(slow.fx.server.effects(), 1);
}

/// A raw MCP session on `/mcp` of a `toolgate serve` child (ureq, no SDK).
pub(crate) struct HttpSession {
    http: ureq::Agent,
    url: String,
    token: String,
    sid: Option<String>,
    /// A `Toolgate-Fault` header for every request (a demo ledger's).
    fault: Option<String>,
}

impl HttpSession {
    /// A client that has not initialized yet.
    pub(crate) fn new(url: &str, token: &str) -> Self {
        let http: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Self { http, url: format!("{url}/mcp"), token: token.to_string(), sid: None, fault: None }
    }

    pub(crate) fn open(url: &str, token: &str) -> Self {
        let mut s = Self::new(url, token);
        let (st, msgs) = s.post(
            json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
            .to_string()
            .as_bytes(),
        );
        assert_eq!(st, 200, "{msgs:?}");
        assert!(s.sid.is_some(), "a session id");
        let (st, _) = s.post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string().as_bytes());
        assert!(st == 202 || st == 200, "{st}");
        s
    }

    /// POSTs `body`; the HTTP status and the JSON-RPC messages of the answer
    /// (a JSON body, or the `data:` lines of an event stream).
    pub(crate) fn post(&mut self, body: &[u8]) -> (u16, Vec<Value>) {
        let (st, sid, msgs) = self.exchange(body);
        if self.sid.is_none() {
            self.sid = sid;
        }
        (st, msgs)
    }

    /// [`HttpSession::post`] on a shared session (from several threads).
    pub(crate) fn exchange(&self, body: &[u8]) -> (u16, Option<String>, Vec<Value>) {
        let mut r = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-06-18")
            .header("authorization", &format!("Bearer {}", self.token));
        if let Some(s) = &self.sid {
            r = r.header("mcp-session-id", s);
        }
        if let Some(f) = &self.fault {
            r = r.header("toolgate-fault", f);
        }
        let mut resp = r.send(body).unwrap();
        let sid = resp.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_string);
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let msgs = match serde_json::from_str::<Value>(&text) {
            Ok(v) => vec![v],
            Err(_) => text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
                .collect(),
        };
        (resp.status().as_u16(), sid, msgs)
    }

    /// The answer to one request (by its id) among the messages of its POST.
    pub(crate) fn request(&self, body: &Value) -> Value {
        let (st, _, msgs) = self.exchange(body.to_string().as_bytes());
        let id = &body["id"];
        msgs.into_iter()
            .find(|m| m.get("id") == Some(id) && m.get("method").is_none())
            .unwrap_or_else(|| panic!("no answer to {id} ({st})"))
    }
}

/// The malformed requests a harness sends (a model's broken output, an old
/// client), each with the JSON-RPC error it must get, by its id.
fn malformed() -> Vec<(&'static str, Vec<u8>, i64, Value)> {
    let call = |id: &str, args: &str| {
        format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"create_refund","arguments":{args}}}}}"#)
            .into_bytes()
    };
    vec![
        ("not JSON", br#"{"jsonrpc":"2.0","id":21,"method":"tools/ca"#.to_vec(), -32700, Value::Null),
        ("jsonrpc 1.0", br#"{"jsonrpc":"1.0","id":22,"method":"tools/list"}"#.to_vec(), -32600, json!(22)),
        (
            "a lone surrogate in an argument",
            call(
                "23",
                r#"{"order_ref":"ord_1001","amount_minor":100,"currency":"EUR","reason":"broken \ud800","idempotency_key":"mcp43-surrogate-01"}"#,
            ),
            -32602,
            json!(23),
        ),
        (
            "bytes that are not UTF-8",
            {
                let mut b = call(
                    "\"u24\"",
                    r#"{"order_ref":"ord_1001","amount_minor":100,"currency":"EUR","reason":"XX","idempotency_key":"mcp43-notutf8-01"}"#,
                );
                let at = b.windows(2).position(|w| w == b"XX").unwrap();
                b[at] = 0xff;
                b
            },
            -32602,
            json!("u24"),
        ),
        ("arguments as an array", call("25", r#"["ord_1001", 100]"#), -32602, json!(25)),
        (
            "tools/call without a name",
            br#"{"jsonrpc":"2.0","id":26,"method":"tools/call","params":{}}"#.to_vec(),
            -32602,
            json!(26),
        ),
    ]
}

/// §3, §4 over stdio: an initialize without a protocol version is refused
/// by its id and the session lives on; every malformed request is answered
/// by its id (-32700 with id null when none can be read); nothing of them
/// reaches the ledger; JSON-RPC ids 10 and "10" are two calls.
#[test]
fn every_request_with_an_id_is_answered_over_stdio() {
    let f = crate::support::Fixture::on(crate::support::Backend::Sqlite);
    let created =
        super::toolgate(f.path(), &["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"]);
    let mut c = Raw::start(f.path(), None, created["token"].as_str().unwrap(), &[]);
    c.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}));
    let bad = c.answer(&json!(1), Duration::from_secs(10));
    assert_eq!(bad["error"]["code"], -32602, "{bad}");
    let init = c.initialize();
    assert_eq!(init["result"]["serverInfo"]["name"], "toolgate", "the session survived: {init}");
    for (what, line, code, id) in malformed() {
        c.send_line(&line);
        let a = c.try_answer(&id, Duration::from_secs(5)).unwrap_or_else(|| panic!("{what}: no answer"));
        assert_eq!(a["error"]["code"], code, "{what}: {a}");
    }
    c.send(&json!({"jsonrpc": "2.0", "id": 30, "method": "tools/list"}));
    let list = c.answer(&json!(30), Duration::from_secs(5));
    assert!(list["result"]["tools"].as_array().is_some_and(|t| !t.is_empty()), "{list}");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 0, "nothing malformed reached the ledger");
    // §4: ids 10 and "10" are two requests, two calls.
    for (id, key) in [(json!(10), "mcp43-id-number-10"), (json!("10"), "mcp43-id-string-10")] {
        c.send(&tools_call(&id, "create_refund", &refund("ord_1002", 150, key)));
        let m = model(&c.answer(&id, Duration::from_secs(10)));
        assert_eq!(m["status"], "succeeded", "id {id}: {m}");
    }
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 2);
}

/// §3 over streamable HTTP: the same malformed requests on `/mcp` are
/// answered by their id (a parse error with id null is a 400), and an
/// initialize without a protocol version is refused by its id.
fn every_request_with_an_id_is_answered_over_http(backend: crate::support::Backend) {
    use crate::serve::{agent_token, Server};
    let f = crate::support::Fixture::on(backend);
    let token = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let mut s = HttpSession::open(&server.url, &token);
    let fresh = HttpSession::new(&server.url, &token);
    let bad = fresh.request(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}));
    assert_eq!(bad["error"]["code"], -32602, "{bad}");
    for (what, body, code, id) in malformed() {
        let (st, msgs) = s.post(&body);
        let a = msgs
            .iter()
            .find(|m| m.get("id") == Some(&id))
            .unwrap_or_else(|| panic!("{what}: no answer ({st}) {msgs:?}"));
        assert_eq!(a["error"]["code"], code, "{what}: {a}");
        assert_eq!(st, if id.is_null() { 400 } else { 200 }, "{what}");
    }
    let list = s.request(&json!({"jsonrpc": "2.0", "id": 30, "method": "tools/list"}));
    assert!(list["result"]["tools"].as_array().is_some_and(|t| !t.is_empty()), "{list}");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 0, "nothing malformed reached the ledger");
}

crate::on_both_backends!(every_request_with_an_id_is_answered_over_http);

/// §1 and §2 over streamable HTTP (`toolgate serve --threads 2`, a demo
/// ledger whose calls take 3 s by their `Toolgate-Fault` header): six calls
/// in one session, the sixth cancelled while queued ends `CANCELLED` at once
/// with the client's operator-log entry and no effect; a second call with a
/// key in flight is `IN_PROGRESS` (status reference in the model's text),
/// and on the HTTP API the same is a 409 `IN_PROGRESS` with Retry-After.
fn cancel_and_in_progress_over_http(backend: crate::support::Backend) {
    use crate::serve::{agent_token, Server};
    let f = crate::support::Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let token = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let mut s = HttpSession::open(&server.url, &token);
    let schemas = Schemas::of(&s.request(&json!({"jsonrpc": "2.0", "id": "list", "method": "tools/list"})));
    s.fault = Some("latency(3000)".into());
    let op = |key: &str| {
        f.query_text(&format!("SELECT state || ':' || coalesce(code, '') FROM operations WHERE idem_key = '{key}'"))
    };
    let key = |i: i64| format!("mcp43-hcancel-{i:04}");
    let victim = std::thread::scope(|scope| {
        let calls: Vec<_> = (1..=6)
            .map(|i| {
                let (s, key) = (&s, key(i));
                let h = scope.spawn(move || {
                    let (_, _, msgs) = s.exchange(
                        tools_call(&json!(i), "create_refund", &refund("ord_1002", 100 + i, &key))
                            .to_string()
                            .as_bytes(),
                    );
                    msgs
                });
                std::thread::sleep(Duration::from_millis(50));
                h
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        // Two engines, six calls of 3 s: four wait. Which ones is the HTTP
        // server's business (the requests race); cancel one still waiting.
        let victim: i64 = (1..=6).rev().find(|&i| op(&key(i)).is_none()).expect("a call still queued");
        let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": victim, "reason": "gave up"}});
        let (st, _, _) = s.exchange(cancel.to_string().as_bytes());
        assert!(st < 300, "{st}");
        let took = within(Duration::from_secs(3), "the queued call cancelled", || {
            op(&key(victim)).as_deref() == Some("failed:CANCELLED")
        });
        eprintln!("HTTP: cancel of a queued call applied {took:?} after the notification");

        for (i, h) in (1..=6).zip(calls) {
            let msgs = h.join().unwrap();
            if i != victim {
                let a = msgs
                    .iter()
                    .find(|m| m.get("id") == Some(&json!(i)))
                    .unwrap_or_else(|| panic!("call {i}: {msgs:?}"));
                assert_eq!(model(a)["status"], "succeeded", "{a}");
            }
        }
        victim
    });
    std::thread::scope(|scope| {
        // §2: a call with a key in flight elsewhere.
        let args = refund("ord_1002", 990, "mcp43-hinprogress-1");
        let first = {
            let (s, args) = (&s, args.clone());
            scope.spawn(move || s.request(&tools_call(&json!(40), "create_refund", &args)))
        };
        within(Duration::from_secs(5), "the first call in flight", || op("mcp43-hinprogress-1").is_some());
        let second = s.request(&tools_call(&json!(41), "create_refund", &args));
        let m = schemas.model("create_refund", &second);
        assert_eq!(m["error"]["code"], "IN_PROGRESS", "{m}");
        assert!(m["error"]["detail"]["status_ref"].as_str().is_some_and(|r| r.starts_with("sr1_")), "{m}");
        assert_eq!(second["result"]["_meta"]["toolgate/status_ref"], m["error"]["detail"]["status_ref"]);
        assert_eq!(model(&first.join().unwrap())["status"], "succeeded");
    });
    assert_eq!(op(&key(victim)).as_deref(), Some("failed:CANCELLED"));
    let cancelled = f.query_i64(&format!(
        "SELECT count(*) FROM audit_log a JOIN operations o ON o.id = a.operation_id \
         WHERE o.idem_key = '{}' AND a.action = 'cancel' AND a.actor = 'mcp-client' AND a.result = 'applied'",
        key(victim)
    ));
    assert_eq!(cancelled, 1, "the client's cancellation in the operator log");
    assert_eq!(
        f.engine().counts().unwrap().downstream_effects,
        6,
        "five calls and the in-progress one; none for the cancelled"
    );

    // The HTTP API: the same key while its first request runs is a 409 IN_PROGRESS.
    let http: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let post = |key: &str| {
        let mut resp = http
            .post(&format!("{}/v1/tools/create_refund/calls", server.url))
            .header("content-type", "application/json")
            .header("authorization", &format!("Bearer {token}"))
            .header("idempotency-key", key)
            .header("toolgate-fault", "latency(2000)")
            .send(r#"{"order_ref":"ord_1002","amount_minor":777,"currency":"EUR","reason":"damaged"}"#)
            .unwrap();
        let retry = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
        (
            resp.status().as_u16(),
            retry,
            serde_json::from_str::<Value>(&resp.body_mut().read_to_string().unwrap()).unwrap(),
        )
    };
    std::thread::scope(|scope| {
        let first = scope.spawn(|| post("api43-inprogress-1"));
        within(Duration::from_secs(5), "the API call in flight", || op("api43-inprogress-1").is_some());
        let (st, retry, body) = post("api43-inprogress-1");
        assert_eq!(st, 409, "{body}");
        assert_eq!(body["model_result"]["error"]["code"], "IN_PROGRESS", "{body}");
        assert!(retry.is_some(), "a Retry-After");
        assert_eq!(first.join().unwrap().0, 200);
    });
}

crate::on_both_backends!(cancel_and_in_progress_over_http);

/// §6: SIGTERM with three calls: one that finishes within the grace period
/// (answered, succeeded), one that does not (detached: out of `in_flight`
/// into the unknown queue, the operator log naming `mcp-shutdown`), one
/// still queued (never started: no operation, no effect). The process exits
/// within the grace period and a second; nothing is left `in_flight`, no
/// lease is left held.
#[test]
fn sigterm_lets_calls_reach_a_durable_step_and_leaves_nothing_in_flight() {
    // The provider's first request takes 1 s, its second 8 s.
    let slow = Slow::with_faults("latency(1000),latency(8000)");
    let mut c = slow.mcp(&["--concurrency", "2", "--grace-ms", "2000"]);
    c.send(&tools_call(&json!(1), "create_refund", &refund("ord_1002", 101, "mcp43-term-0001")));
    std::thread::sleep(Duration::from_millis(200));
    c.send(&tools_call(&json!(2), "create_refund", &refund("ord_1002", 102, "mcp43-term-0002")));
    c.send(&tools_call(&json!(3), "create_refund", &refund("ord_1002", 103, "mcp43-term-0003")));
    within(Duration::from_secs(5), "two calls in flight", || slow.op("mcp43-term-0002").is_some());
    let t = Instant::now();
    c.terminate();
    let first = model(&c.answer(&json!(1), Duration::from_secs(3)));
    assert_eq!(first["status"], "succeeded", "a call that ends within the grace period is answered: {first}");
    let st = c.wait_exit(Duration::from_secs(4)).expect("the server exits within its grace period");
    let took = t.elapsed();
    eprintln!("SIGTERM to exit: {took:?}");
    assert_eq!(st.code(), Some(0), "{st:?}");
    assert_eq!(slow.op("mcp43-term-0001"), Some(("succeeded".into(), None)));
    let (state, _) = slow.op("mcp43-term-0002").unwrap();
    assert_ne!(state, "in_flight", "nothing left in flight");
    assert_eq!(state, "unknown", "detached after send: the unknown queue");
    let log = slow.audit("mcp43-term-0002");
    assert!(log.contains(&("mcp-shutdown".into(), "cancel".into(), "applied".into())), "{log:?}");
    assert_eq!(slow.op("mcp43-term-0003"), None, "the queued call never started");
    let c = rusqlite::Connection::open(&slow.fx.ledger).unwrap();
    let leased: i64 = c
        .query_row("SELECT count(*) FROM outbox WHERE lease_owner IS NOT NULL AND state = 'leased'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(leased, 0, "no lease left held");
}

/// §6: the end of input (a harness closing stdin before its SIGTERM) is a
/// shutdown too: the call in flight is detached after the grace period, the
/// process exits before the SIGTERM the Python SDK would send 2 s later.
#[test]
fn closing_stdin_detaches_a_call_still_in_flight_after_the_grace_period() {
    let slow = Slow::with_faults("latency(8000)");
    let mut c = slow.mcp(&["--grace-ms", "1000"]);
    c.send(&tools_call(&json!(1), "create_refund", &refund("ord_1002", 111, "mcp43-eof-0001")));
    within(Duration::from_secs(5), "the call in flight", || slow.op("mcp43-eof-0001").is_some());
    let t = Instant::now();
    c.close_stdin();
    // Bounds for a loaded machine (alone: answered and exited ~1.3 s after the
    // close, the 1 s grace included); the call's 8 s latency is what they
    // tell apart from.
    let unknown = model(&c.answer(&json!(1), Duration::from_secs(20)));
    // Succeeded would mean it waited the call's 8 s out instead of detaching it.
    assert_eq!(unknown["error"]["code"], "OUTCOME_UNKNOWN", "{unknown}");
    let st = c.wait_exit(Duration::from_secs(20)).expect("exits by itself, with the call detached");
    eprintln!("end of input to exit: {:?}", t.elapsed());
    assert_eq!(st.code(), Some(0));
    assert_eq!(slow.op("mcp43-eof-0001").map(|o| o.0).as_deref(), Some("unknown"));
}

/// §1, §2, §5, §6 with the official Python MCP SDK (`pip install mcp`, which
/// `.ci/run` installs): the SDK's own cancellation of a queued call wins at
/// once (`CANCELLED`, no effect, the client's operator-log entry); the same
/// key while its first call runs is `IN_PROGRESS` with the status reference
/// in the text the model reads; the SDK's own outputSchema validation of
/// every success passes; leaving the session stops the server with nothing
/// left in flight.
#[test]
fn the_python_sdk_drives_cancel_in_progress_and_output_schema() {
    let slow = Slow::new(3000, 8);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/mcp_sdk_harness.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(assert_cmd::cargo::cargo_bin("toolgate"))
        .arg(&slow.fx.ledger)
        .arg(&slow.fx.catalog)
        .arg(&slow.token)
        .output()
        .expect("python3 (with the `mcp` package: .ci/run installs it)");
    assert!(out.status.success(), "the SDK run failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(seen["output_schema"].as_object().unwrap().values().all(|v| v == true), "{seen:#}");
    for i in 1..=5 {
        let c = &seen["calls"][i.to_string()];
        assert_eq!(c["is_error"], false, "call {i}: {c:#}");
        assert_eq!(c["structured"]["status"], "succeeded", "call {i}: {c:#}");
    }
    assert!(seen["calls"].get("6").is_none(), "the cancelled call has no answer");
    assert_eq!(slow.op("py43-cancel-0006"), Some(("failed".into(), Some("CANCELLED".into()))));
    let log = slow.audit("py43-cancel-0006");
    assert!(log.contains(&("mcp-client".into(), "cancel".into(), "applied".into())), "{log:?}");
    let dup = &seen["duplicate"];
    assert_eq!(dup["structured"]["error"]["code"], "IN_PROGRESS", "{dup:#}");
    let status_ref = dup["structured"]["error"]["detail"]["status_ref"].as_str().unwrap();
    assert!(dup["text"].as_str().unwrap().contains(status_ref), "the model's text carries the status reference");
    assert_eq!(seen["first"]["structured"]["status"], "succeeded");
    assert_eq!(slow.fx.server.effects(), 6, "five calls and the in-progress one; none for the cancelled");
    let c = rusqlite::Connection::open(&slow.fx.ledger).unwrap();
    let in_flight: i64 =
        c.query_row("SELECT count(*) FROM operations WHERE state = 'in_flight'", [], |r| r.get(0)).unwrap();
    assert_eq!(in_flight, 0);
}

/// §6 over streamable HTTP: SIGTERM to `serve` while an MCP call is in
/// flight ends its session, and that is not the client's cancellation: the
/// call reaches its durable end (succeeded, one effect), no `mcp-client`
/// cancellation is logged, the server exits 0, nothing is left in flight.
/// A guard, not a reproduction: `serve` already drained this way before issue
/// 43 (rmcp's session stop does not end a request in flight); it holds the
/// HTTP side to what the stdio fix promises.
fn sigterm_to_serve_is_not_a_clients_cancellation(backend: crate::support::Backend) {
    use crate::serve::{agent_token, Server};
    let f = crate::support::Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let token = agent_token(f.path(), "acme", "agent_ana");
    let mut server = Server::start(f.path(), &[]);
    let mut s = HttpSession::open(&server.url, &token);
    s.fault = Some("latency(1500)".into());
    let key = "mcp43-serve-term-1";
    let state = || f.query_text(&format!("SELECT state FROM operations WHERE idem_key = '{key}'"));
    std::thread::scope(|scope| {
        let s = &s;
        let call = scope.spawn(move || {
            s.exchange(tools_call(&json!(1), "create_refund", &refund("ord_1002", 321, key)).to_string().as_bytes())
        });
        within(Duration::from_secs(5), "the call in flight", || state().is_some());
        assert_eq!(server.terminate().code(), Some(0));
        let _ = call.join();
    });
    assert_eq!(state().as_deref(), Some("succeeded"), "the call reached its durable end");
    let by_client = f.query_i64(&format!(
        "SELECT count(*) FROM audit_log a JOIN operations o ON o.id = a.operation_id \
         WHERE o.idem_key = '{key}' AND a.actor = 'mcp-client'"
    ));
    assert_eq!(by_client, 0, "a shutdown is not the client's cancellation");
    assert_eq!(f.engine().counts().unwrap().downstream_effects, 1);
    assert_eq!(f.query_i64("SELECT count(*) FROM operations WHERE state = 'in_flight'"), 0);
}

crate::on_both_backends!(sigterm_to_serve_is_not_a_clients_cancellation);
