//! `toolgate serve` (issue 17 §1, §2, §5): a real child process on an
//! ephemeral loopback port, driven by a real HTTP client (ureq), on both
//! backends. Every scenario checks the HTTP status, the envelope's code and
//! delivery, and what the ledger holds afterwards.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{refund_args, Backend, Fixture};

pub(crate) fn bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("toolgate")
}

/// A `toolgate serve` child on an ephemeral loopback port; killed on drop.
pub(crate) struct Server {
    child: Option<Child>,
    pub(crate) url: String,
    addr: String,
}

impl Server {
    pub(crate) fn start(db: &Path, extra: &[&str]) -> Self {
        let mut c = Command::new(bin());
        c.arg("--db").arg(db).args(extra).args(["serve", "--listen", "127.0.0.1:0", "--threads", "2"]);
        Self::from_command(c)
    }

    /// [`Server::start`] with arguments of `serve` itself.
    pub(crate) fn start_serving(db: &Path, serve: &[&str]) -> Self {
        let mut c = Command::new(bin());
        c.arg("--db").arg(db).args(["serve", "--listen", "127.0.0.1:0", "--threads", "2"]).args(serve);
        Self::from_command(c)
    }

    /// Spawns a `serve` command (any program that runs one, `faketime` too)
    /// and waits for the address it prints.
    pub(crate) fn from_command(mut c: Command) -> Self {
        let mut child = c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let url =
            line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("no address in {line:?}")).to_string();
        let addr = url.trim_start_matches("http://").to_string();
        Self { child: Some(child), url, addr }
    }

    /// The child's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILL (unless it is already dead: a fault may abort it), then the exit status.
    pub(crate) fn kill(&mut self) -> ExitStatus {
        let mut child = self.child.take().unwrap();
        let _ = child.kill();
        child.wait().unwrap()
    }

    /// SIGTERM, then the exit status.
    pub(crate) fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().unwrap();
        let ok = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(ok.success());
        child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `toolgate token create ...` → the token.
fn token(db: &Path, args: &[&str]) -> String {
    let out = Command::new(bin()).arg("--db").arg(db).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["token"].as_str().unwrap().to_string()
}

pub(crate) fn agent_token(db: &Path, tenant: &str, subject: &str) -> String {
    token(db, &["token", "create", "--tenant", tenant, "--subject", subject, "--json"])
}

pub(crate) fn operator_token(db: &Path, name: &str) -> String {
    token(db, &["--operator", name, "token", "create", "--all-tenants", "--json"])
}

/// An operator token limited to some tenants.
pub(crate) fn scoped_operator_token(db: &Path, name: &str, tenants: &[&str]) -> String {
    let mut args = vec!["--operator", name, "token", "create", "--json"];
    for t in tenants {
        args.extend(["--tenant", t]);
    }
    token(db, &args)
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) retry_after: Option<String>,
    pub(crate) body: Value,
}

impl Answer {
    pub(crate) fn code(&self) -> Option<&str> {
        self.body["model_result"]["error"]["code"].as_str()
    }
    fn delivery(&self) -> &str {
        self.body["model_result"]["execution"]["delivery"].as_str().unwrap_or("?")
    }
    fn status_ref(&self) -> &str {
        self.body["protected_audit"]["downstream"]["status_ref"].as_str().unwrap()
    }
    fn request_sha256(&self) -> &str {
        self.body["protected_audit"]["binding"]["request_sha256"].as_str().unwrap()
    }
    fn operation_id(&self) -> &str {
        self.body["protected_audit"]["operation_id"].as_str().unwrap()
    }
    fn outcome(&self) -> &str {
        self.body["model_result"]["execution"]["outcome"].as_str().unwrap_or("?")
    }
    fn approval_id(&self) -> &str {
        self.body["protected_audit"]["approval_id"].as_str().unwrap()
    }
    fn retry_after_ms(&self) -> Option<u64> {
        self.body["model_result"]["error"]["retry_after_ms"].as_u64()
    }
    fn refund_id(&self) -> &str {
        self.body["model_result"]["data"]["refund_id"].as_str().unwrap()
    }
}

pub(crate) struct Client {
    agent: ureq::Agent,
    url: String,
}

impl Client {
    pub(crate) fn new(server: &Server) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        Self { agent, url: server.url.clone() }
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Answer {
        self.try_send(method, path, token, headers, body).unwrap()
    }

    /// [`Client::send`], with a failed exchange (refused, reset, cut short) as
    /// an error instead of a panic. Every answer that arrives must be JSON.
    pub(crate) fn try_send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<Answer, ureq::Error> {
        let url = format!("{}{path}", self.url);
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = if method == "GET" {
            let mut r = self.agent.get(&url);
            if let Some(a) = &auth {
                r = r.header("authorization", a);
            }
            for (k, v) in headers {
                r = r.header(*k, *v);
            }
            r.call()
        } else {
            let mut r = self.agent.post(&url);
            if let Some(a) = &auth {
                r = r.header("authorization", a);
            }
            for (k, v) in headers {
                r = r.header(*k, *v);
            }
            r.send(body.unwrap_or(b""))
        };
        let mut resp = resp?;
        let status = resp.status().as_u16();
        let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
        let text = resp.body_mut().read_to_string()?;
        let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON ({status}): {text}"));
        Ok(Answer { status, retry_after, body })
    }

    /// `POST /v1/tools/{tool}/calls` with a JSON body and an optional key.
    fn call(&self, token: &str, tool: &str, key: Option<&str>, args: &str, extra: &[(&str, &str)]) -> Answer {
        self.try_call(token, tool, key, args, extra).unwrap()
    }

    /// [`Client::call`], a failed exchange as an error.
    pub(crate) fn try_call(
        &self,
        token: &str,
        tool: &str,
        key: Option<&str>,
        args: &str,
        extra: &[(&str, &str)],
    ) -> Result<Answer, ureq::Error> {
        let mut h = vec![("content-type", "application/json")];
        if let Some(k) = key {
            h.push(("idempotency-key", k));
        }
        h.extend_from_slice(extra);
        self.try_send("POST", &format!("/v1/tools/{tool}/calls"), Some(token), &h, Some(args.as_bytes()))
    }

    pub(crate) fn post_json(&self, token: &str, path: &str, body: &Value) -> Answer {
        let text = body.to_string();
        self.send("POST", path, Some(token), &[("content-type", "application/json")], Some(text.as_bytes()))
    }
}

fn effects(f: &Fixture) -> i64 {
    f.engine().counts().unwrap().downstream_effects
}

/// Everything a refusal must leave alone: operations, outbox rows, effects,
/// approvals, tokens (the trace may grow by its events).
fn business_snapshot(f: &Fixture) -> Vec<i64> {
    ["operations", "outbox", "provider_effects", "approvals", "call_identities", "api_tokens", "orders"]
        .iter()
        .map(|t| f.query_i64(&format!("SELECT count(*) FROM {t}")))
        .chain([f.query_i64("SELECT CAST(coalesce(sum(refunded_minor), 0) AS BIGINT) FROM orders")])
        .collect()
}

fn fresh_dispatch_replay_conflict_and_missing_key(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let args = refund_args("ord_1001", 1000);

    let first = c.call(&ana, "create_refund", Some("refund-http-0001"), &args, &[]);
    assert_eq!((first.status, first.code(), first.delivery()), (200, None, "fresh"), "{:#}", first.body);
    let refund_id = first.body["model_result"]["data"]["refund_id"].as_str().unwrap().to_string();

    // The model retries under a new call id: a local replay of the same refund, no second effect.
    let again = c.call(&ana, "create_refund", Some("refund-http-0001"), &args, &[("toolgate-call-id", "call_2")]);
    assert_eq!((again.status, again.delivery()), (200, "local_replay"));
    assert_eq!(again.body["model_result"]["data"]["refund_id"], refund_id.as_str());

    // Same key, another amount: 422, nothing changes.
    let before = business_snapshot(&f);
    let other = c.call(&ana, "create_refund", Some("refund-http-0001"), &refund_args("ord_1001", 1500), &[]);
    assert_eq!((other.status, other.code()), (422, Some("IDEMPOTENCY_CONFLICT")));
    assert_eq!(other.body["model_result"]["error"]["retryable"], false);

    // A write tool without a key: 400, before any state.
    let keyless = c.call(&ana, "create_refund", None, &args, &[]);
    assert_eq!((keyless.status, keyless.code()), (400, Some("IDEMPOTENCY_KEY_REQUIRED")));
    assert_eq!(business_snapshot(&f)[..1], before[..1]);
    assert_eq!(effects(&f), 1);

    // The caller reads its own operation.
    let op = c.send("GET", &format!("/v1/operations/{}", first.operation_id()), Some(&ana), &[], None);
    assert_eq!((op.status, op.delivery()), (200, "local_replay"));
    assert_eq!(op.body["model_result"]["data"]["refund_id"], refund_id.as_str());

    // A read tool needs no key.
    let read = c.call(&ana, "get_order", None, r#"{"order_ref":"ord_1001"}"#, &[]);
    assert_eq!(read.status, 200, "{:#}", read.body);
    assert_eq!(read.body["model_result"]["data"]["refunded_minor"], 1000);
}

fn a_lost_reply_is_unknown_until_a_status_query_reconciles_it(backend: Backend) {
    let f = Fixture::on(backend);
    // Faults come in a request header only on a database marked as a demo.
    f.engine().mark_demo(crate::support::T0).unwrap();
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let args = refund_args("ord_1004", 700);
    let fault = [("toolgate-fault", "timeout_after_commit")];

    let lost = c.call(&ana, "create_refund", Some("refund-http-lost-1"), &args, &fault);
    assert_eq!((lost.status, lost.code()), (504, Some("OUTCOME_UNKNOWN")), "{:#}", lost.body);
    assert_eq!(lost.body["model_result"]["error"]["recovery"], "query_status");
    assert_eq!(effects(&f), 1, "the provider committed");

    // A retry with the same key never executes again: still unknown, same status_ref.
    let retry = c.call(&ana, "create_refund", Some("refund-http-lost-1"), &args, &[]);
    assert_eq!((retry.status, retry.code()), (504, Some("OUTCOME_UNKNOWN")));
    assert_eq!(retry.status_ref(), lost.status_ref());
    assert_eq!(effects(&f), 1);

    // The explicit status query finds the receipt.
    let q = c.post_json(
        &ana,
        "/v1/status-queries",
        &json!({"status_ref": lost.status_ref(), "expected_request_sha256": lost.request_sha256()}),
    );
    assert_eq!((q.status, q.code(), q.delivery()), (200, None, "receipt_reconciled"), "{:#}", q.body);

    let replay = c.call(&ana, "create_refund", Some("refund-http-lost-1"), &args, &[]);
    assert_eq!((replay.status, replay.delivery()), (200, "local_replay"));
    assert_eq!(effects(&f), 1);
    assert_eq!(f.engine().counts().unwrap().side_effect_duplicates, 0);
}

/// A provider that takes one request and holds it until told to drop it.
struct HoldingProvider {
    url: String,
    received: std::sync::mpsc::Receiver<()>,
    release: std::sync::mpsc::Sender<()>,
}

impl HoldingProvider {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (got, received) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 1 << 20 {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = got.send(());
            // Held until the test says so (or gives up), then dropped with no reply.
            let _ = released.recv_timeout(Duration::from_secs(120));
            drop(s);
        });
        Self { url, received, release }
    }
}

/// The demo catalog behind HTTP, pointed at `base_url`, with attempts that
/// wait as long as the provider holds them (the test releases it).
fn held_catalog(dir: &Path, base_url: &str) -> PathBuf {
    let out = crate::http::write_catalog(dir, base_url, None);
    for name in ["create_refund.json", "notify_customer.json"] {
        let p = out.join(name);
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["retry"]["attempt_timeout_ms"] = Value::from(60_000);
        v["retry"]["deadline_ms"] = Value::from(120_000);
        std::fs::write(&p, v.to_string()).unwrap();
    }
    out
}

fn the_same_key_while_in_flight_is_409_with_retry_after(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let provider = HoldingProvider::start();
    let catalog = held_catalog(f.scratch(), &provider.url);
    let server = Server::start(f.path(), &["--catalog", catalog.to_str().unwrap()]);
    let c = std::sync::Arc::new(Client::new(&server));
    let args = refund_args("ord_1001", 900);

    let first = {
        let (c, ana, args) = (c.clone(), ana.clone(), args.clone());
        std::thread::spawn(move || c.call(&ana, "create_refund", Some("refund-http-held-1"), &args, &[]))
    };
    // The provider has the request: the sent-marker committed before it was sent.
    provider.received.recv_timeout(Duration::from_secs(60)).unwrap();
    let dup = c.call(&ana, "create_refund", Some("refund-http-held-1"), &args, &[("toolgate-call-id", "call_dup")]);
    // Running, not unknown (issue 43 §2): IN_PROGRESS, with what a status query needs.
    assert_eq!((dup.status, dup.code()), (409, Some("IN_PROGRESS")), "{:#}", dup.body);
    assert_eq!(dup.body["model_result"]["error"]["recovery"], "retry_after", "{:#}", dup.body);
    assert_eq!(
        dup.body["model_result"]["error"]["detail"]["status_ref"].as_str(),
        Some(dup.status_ref()),
        "{:#}",
        dup.body
    );
    assert!(dup.retry_after.as_deref().is_some_and(|s| s.parse::<u64>().is_ok()), "{:?}", dup.retry_after);
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 1);
    assert_eq!(f.query_i64("SELECT count(*) FROM attempts"), 1, "the duplicate sent nothing");

    // The provider drops the connection: the first caller learns the outcome is unknown.
    provider.release.send(()).unwrap();
    let first = first.join().unwrap();
    assert_eq!(first.code(), Some("OUTCOME_UNKNOWN"), "{:#}", first.body);
    assert_eq!(first.status_ref(), dup.status_ref());
}

fn tokens_are_checked_at_every_request_and_never_stored(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    // Expired from the start as the server sees it (the system clock is past 2020).
    let expired = token(
        f.path(),
        &[
            "--now",
            "2020-01-01T00:00:00Z",
            "token",
            "create",
            "--tenant",
            "acme",
            "--subject",
            "agent_ana",
            "--expires",
            "2020-01-02T00:00:00Z",
            "--json",
        ],
    );
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let read = r#"{"order_ref":"ord_1001"}"#;
    assert_eq!(c.call(&ana, "get_order", None, read, &[]).status, 200);

    let before = business_snapshot(&f);
    let h = [("content-type", "application/json")];
    let path = "/v1/tools/get_order/calls";
    let refused = |auth: Option<&str>| {
        let mut headers = h.to_vec();
        if let Some(a) = auth {
            headers.push(("authorization", a));
        }
        c.send("POST", path, None, &headers, Some(read.as_bytes()))
    };
    // `tgt_` + 16 hex digits, `_`, then the secret (base64url, which may itself hold `_`).
    let (public, secret) = (&ana[..20], &ana[21..]);
    assert_eq!((&ana[..4], &ana[20..21], secret.len()), ("tgt_", "_", 43), "{ana}");
    let wrong_secret = format!("Bearer {public}_{}", "A".repeat(secret.len()));
    let unknown = format!("Bearer tgt_0000000000000000_{}", "A".repeat(43));
    for (auth, code) in [
        (None, "TOKEN_MISSING"),
        (Some("Bearer nope"), "TOKEN_MALFORMED"),
        (Some("Basic YWxpY2U6c2VjcmV0"), "TOKEN_MALFORMED"),
        (Some(unknown.as_str()), "TOKEN_UNKNOWN"),
        (Some(wrong_secret.as_str()), "TOKEN_UNKNOWN"),
        (Some(&format!("Bearer {expired}")), "TOKEN_EXPIRED"),
    ] {
        let a = refused(auth);
        assert_eq!((a.status, a.code()), (401, Some(code)), "{auth:?}: {:#}", a.body);
        assert_eq!(a.body["model_result"]["data"], Value::Null);
    }

    // Revoked mid-run: the very next request is refused.
    let id = {
        let out = Command::new(bin()).arg("--db").arg(f.path()).args(["token", "list", "--json"]).output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let list = v["tokens"].as_array().unwrap().clone();
        let mine = list.iter().find(|t| ana.starts_with(t["prefix"].as_str().unwrap())).unwrap();
        assert!(mine.get("secret_sha256").is_none() && !v.to_string().contains(secret));
        mine["id"].as_str().unwrap().to_string()
    };
    let out = Command::new(bin()).arg("--db").arg(f.path()).args(["token", "revoke", &id]).output().unwrap();
    assert!(out.status.success());
    let a = c.call(&ana, "get_order", None, read, &[]);
    assert_eq!((a.status, a.code()), (401, Some("TOKEN_REVOKED")));
    assert_eq!(business_snapshot(&f)[..5], before[..5], "a refused token writes nothing but its trace");
    // Sampled into the trace (at most one a second, saying how many it stands
    // for), every one counted in the metrics (issue 33 Medium 6).
    let sampled = f.query_i64("SELECT count(*) FROM trace_events WHERE step = 'authentication'");
    assert!((1..=7).contains(&sampled), "{sampled}");
    assert!(
        f.query_i64("SELECT count(*) FROM trace_events WHERE step = 'authentication' AND fields LIKE '%refusal(s)%'")
            >= 1
    );

    // The raw token is nowhere: not in any token row, not in the trace, not in the log.
    assert_eq!(
        f.query_i64(&format!(
            "SELECT count(*) FROM api_tokens WHERE secret_sha256 LIKE '%{secret}%' OR prefix LIKE '%{secret}%'"
        )),
        0
    );
    assert_eq!(f.query_i64(&format!("SELECT count(*) FROM trace_events WHERE fields LIKE '%{secret}%'")), 0);
    if backend == Backend::Sqlite {
        for p in [f.path().to_path_buf(), f.path().with_extension("db-wal"), f.path().with_extension("db.log")] {
            if let Ok(bytes) = std::fs::read(&p) {
                assert!(
                    !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "{} holds the token",
                    p.display()
                );
            }
        }
    }
}

fn other_callers_ids_are_404_and_agents_cannot_act_as_operators(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let ben = agent_token(f.path(), "acme", "agent_ben");
    let gus = agent_token(f.path(), "globex", "agent_gus");
    let alice = operator_token(f.path(), "alice");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);

    let mine = c.call(&ana, "create_refund", Some("refund-http-own-1"), &refund_args("ord_1001", 100), &[]);
    assert_eq!(mine.status, 200);
    let path = format!("/v1/operations/{}", mine.operation_id());
    let none = c.send("GET", "/v1/operations/op_000000000000000000000000", Some(&ana), &[], None);
    assert_eq!((none.status, none.code()), (404, Some("NO_SUCH_OPERATION")));
    for other in [&gus, &ben] {
        let a = c.send("GET", &path, Some(other), &[], None);
        assert_eq!(a.status, 404);
        assert_eq!(a.body, none.body, "someone else's operation reads exactly like none");
    }
    assert_eq!(c.send("GET", &path, Some(&alice), &[], None).status, 200, "an operator sees every operation");

    // Above the threshold: an approval request holds the exact call.
    let big = refund_args("ord_1002", 60_000);
    let held = c.call(&ana, "create_refund", Some("refund-http-big-1"), &big, &[]);
    assert_eq!((held.status, held.code()), (202, Some("APPROVAL_REQUIRED")), "{:#}", held.body);
    let approval = held.body["protected_audit"]["approval_id"].as_str().unwrap().to_string();

    let before = business_snapshot(&f);
    let note = json!({"note": "no"});
    let empty = json!({});
    for (path, body) in [
        (format!("/v1/approvals/{approval}/approve"), &empty),
        (format!("/v1/approvals/{approval}/deny"), &note),
        (format!("/v1/operations/{}/resolve", mine.operation_id()), &json!({"resolution": "failed", "note": "x"})),
        (format!("/v1/operations/{}/cancel", mine.operation_id()), &note),
    ] {
        let a = c.post_json(&ana, &path, body);
        assert_eq!((a.status, a.code()), (403, Some("OPERATOR_TOKEN_REQUIRED")), "{path}");
    }
    let list = c.send("GET", "/v1/approvals", Some(&ana), &[], None);
    assert_eq!((list.status, list.code()), (403, Some("OPERATOR_TOKEN_REQUIRED")));
    assert_eq!(business_snapshot(&f), before, "an agent's operator attempt changes nothing");

    // An operator token cannot dispatch as a subject.
    let as_subject = c.call(&alice, "create_refund", Some("refund-http-op-1"), &refund_args("ord_1001", 100), &[]);
    assert_eq!((as_subject.status, as_subject.code()), (403, Some("SUBJECT_TOKEN_REQUIRED")));

    // The operator lists and approves; the held call runs once.
    let list = c.send("GET", "/v1/approvals", Some(&alice), &[], None);
    assert_eq!(list.status, 200);
    assert!(list.body["pending"].as_array().unwrap().iter().any(|a| a["approval_id"] == approval.as_str()));
    let ok = c.post_json(&alice, &format!("/v1/approvals/{approval}/approve"), &empty);
    assert_eq!(ok.status, 200, "{:#}", ok.body);
    let replay = c.call(&ana, "create_refund", Some("refund-http-big-1"), &big, &[]);
    assert_eq!((replay.status, replay.delivery()), (200, "local_replay"), "{:#}", replay.body);
    assert_eq!(effects(&f), 2);
}

/// Two `Idempotency-Key` headers (either order), two `Authorization` headers
/// or a `Toolgate-*` identity header twice: 400 `DUPLICATE_HEADER`, nothing
/// accepted. (A handler reads one value: the keys in the other order used to
/// be a second intent, a second refund.)
fn an_identity_header_sent_twice_is_refused_and_changes_nothing(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let ben = agent_token(f.path(), "acme", "agent_ben");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let args = refund_args("ord_1001", 700);
    let json = ("content-type", "application/json");
    let path = "/v1/tools/create_refund/calls";
    let ben_bearer = format!("Bearer {ben}");
    for (what, headers) in [
        ("keys A then B", vec![json, ("idempotency-key", "twice-key-aaaa"), ("idempotency-key", "twice-key-bbbb")]),
        ("keys B then A", vec![json, ("idempotency-key", "twice-key-bbbb"), ("idempotency-key", "twice-key-aaaa")]),
        ("two tokens", vec![json, ("idempotency-key", "twice-key-cccc"), ("authorization", ben_bearer.as_str())]),
        (
            "call id twice",
            vec![json, ("idempotency-key", "twice-key-dddd"), ("toolgate-call-id", "c1"), ("toolgate-call-id", "c2")],
        ),
    ] {
        let a = c.send("POST", path, Some(&ana), &headers, Some(args.as_bytes()));
        assert_eq!((a.status, a.code()), (400, Some("DUPLICATE_HEADER")), "{what}: {:?}", a.body);
    }
    // Issue 33 Low: bytes that are not UTF-8 in an identity header were read
    // lossily (two byte strings, one call id): refused.
    for bad in [&b"call-\xff"[..], &b"call-\xfe"[..]] {
        use std::io::Write as _;
        let addr = server.url.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {ana}\r\ncontent-type: application/json\r\nidempotency-key: bad-bytes-key-1\r\ncontent-length: {}\r\ntoolgate-call-id: ",
            args.len()
        )
        .into_bytes();
        req.extend_from_slice(bad);
        req.extend_from_slice(b"\r\nconnection: close\r\n\r\n");
        req.extend_from_slice(args.as_bytes());
        s.write_all(&req).unwrap();
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut s, &mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("INVALID_HEADER"), "{answer}");
    }
    // Issue 33 Low: bodies are objects (an array was read by position, and
    // `["compensated", "note"]` resolved an operation).
    let kim = operator_token(f.path(), "kim");
    let positional = c.send(
        "POST",
        "/v1/operations/op_000000000000000000000000/resolve",
        Some(&kim),
        &[json],
        Some(br#"["compensated", "a note"]"#),
    );
    assert_eq!((positional.status, positional.code()), (400, Some("INVALID_BODY")), "{:?}", positional.body);
    let mut e = f.engine();
    assert!(e.list_operations(None, 10).unwrap().is_empty(), "nothing accepted");
    assert_eq!(effects(&f), 0);
    // One of each is an ordinary call.
    let ok = c.call(&ana, "create_refund", Some("twice-key-aaaa"), &args, &[]);
    assert_eq!(ok.status, 200, "{:?}", ok.body);
}

fn hostile_requests_get_stable_codes_and_change_nothing(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let before = business_snapshot(&f);
    let key = Some("refund-http-hostile-1");
    let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
    let big = format!(r#"{{"order_ref":"{}"}}"#, "x".repeat(70 * 1024));
    let h = [("content-type", "application/json"), ("idempotency-key", "refund-http-hostile-1")];
    let raw = |body: &[u8], extra: &[(&str, &str)]| {
        let mut headers = h.to_vec();
        headers.extend_from_slice(extra);
        c.send("POST", "/v1/tools/create_refund/calls", Some(&ana), &headers, Some(body))
    };
    for (what, a, status, code) in [
        ("over the limit", raw(big.as_bytes(), &[]), 413, "BODY_TOO_LARGE"),
        ("invalid UTF-8", raw(b"{\"order_ref\":\"\xff\"}", &[]), 400, "INVALID_ARGUMENTS"),
        ("duplicate keys", raw(br#"{"amount_minor":1,"amount_minor":2}"#, &[]), 400, "INVALID_ARGUMENTS"),
        ("deep nesting", raw(deep.as_bytes(), &[]), 400, "INVALID_ARGUMENTS"),
        ("not JSON", raw(b"{nope", &[]), 400, "INVALID_ARGUMENTS"),
        (
            "fault off a demo database",
            c.call(
                &ana,
                "create_refund",
                key,
                &refund_args("ord_1001", 5),
                &[("toolgate-fault", "timeout_after_commit")],
            ),
            400,
            "FAULT_NOT_ALLOWED",
        ),
        (
            "bad deadline",
            c.call(&ana, "create_refund", key, &refund_args("ord_1001", 5), &[("toolgate-deadline-ms", "soon")]),
            400,
            "INVALID_HEADER",
        ),
        ("unknown tool", c.call(&ana, "drop_tables", key, "{}", &[]), 404, "UNKNOWN_TOOL"),
        (
            "text/plain",
            c.send("POST", "/v1/tools/create_refund/calls", Some(&ana), &[("content-type", "text/plain")], Some(b"{}")),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            "no content type",
            c.send("POST", "/v1/tools/create_refund/calls", Some(&ana), &[], Some(b"{}")),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            "status query with an unknown field",
            c.post_json(
                &ana,
                "/v1/status-queries",
                &json!({"status_ref": "x", "expected_request_sha256": "y", "tenant": "globex"}),
            ),
            400,
            "INVALID_BODY",
        ),
        (
            "malformed status_ref",
            c.post_json(&ana, "/v1/status-queries", &json!({"status_ref": "x", "expected_request_sha256": "y"})),
            400,
            "INVALID_ARGUMENTS",
        ),
        ("no such route", c.send("GET", "/v1/nope", Some(&ana), &[], None), 404, "NO_SUCH_ROUTE"),
        (
            "wrong method",
            c.send("GET", "/v1/tools/create_refund/calls", Some(&ana), &[], None),
            405,
            "METHOD_NOT_ALLOWED",
        ),
    ] {
        assert_eq!((a.status, a.code()), (status, Some(code)), "{what}: {:#}", a.body);
        assert!(a.body["model_result"]["execution"].is_object(), "{what}: the body is an envelope");
    }
    assert_eq!(business_snapshot(&f), before, "hostile requests changed the ledger");

    // A request head that never finishes is cut off; the server stays up.
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    slow.write_all(b"POST /v1/tools/create_refund/calls HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut rest = Vec::new();
    let _ = slow.read_to_end(&mut rest);
    assert!(rest.is_empty() || String::from_utf8_lossy(&rest).starts_with("HTTP/1.1 408"), "{rest:?}");

    // 200 connections at once, idle: another caller is still answered (a
    // read binds its call identity: the snapshot is taken again after it).
    let idle: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(&server.addr).unwrap()).collect();
    let ok = c.call(&ana, "get_order", None, r#"{"order_ref":"ord_1001"}"#, &[]);
    assert_eq!(ok.status, 200);
    drop(idle);
    let before = business_snapshot(&f);
    // 200 concurrent requests: every one answered.
    let answered: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..200).map(|_| s.spawn(|| c.send("GET", "/healthz", None, &[], None).status)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(answered.iter().all(|s| *s == 200 || *s == 503), "{answered:?}");
    assert_eq!(business_snapshot(&f), before);
}

fn sigterm_lets_the_call_in_flight_finish_and_exits_0(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let provider = HoldingProvider::start();
    let catalog = held_catalog(f.scratch(), &provider.url);
    let mut server = Server::start(f.path(), &["--catalog", catalog.to_str().unwrap()]);
    let c = std::sync::Arc::new(Client::new(&server));
    let in_flight = {
        let (c, ana) = (c.clone(), ana.clone());
        std::thread::spawn(move || {
            c.call(&ana, "create_refund", Some("refund-http-term-1"), &refund_args("ord_1001", 300), &[])
        })
    };
    provider.received.recv_timeout(Duration::from_secs(60)).unwrap();
    let kill = Command::new("kill").args(["-TERM", &server.child.as_ref().unwrap().id().to_string()]).status().unwrap();
    assert!(kill.success());
    // It stops accepting (bounded wait for the listener to close) ...
    let mut refused = false;
    for _ in 0..600 {
        if TcpStream::connect(&server.addr).is_err() {
            refused = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(refused, "still accepting after SIGTERM");
    // ... and the call in flight still gets its answer.
    provider.release.send(()).unwrap();
    let answer = in_flight.join().unwrap();
    assert_eq!(answer.code(), Some("OUTCOME_UNKNOWN"), "{:#}", answer.body);
    let status = server.terminate_wait();
    assert_eq!(status.code(), Some(0));

    // A second server, stopped while idle, exits 0 too.
    let mut idle = Server::start(f.path(), &[]);
    assert_eq!(idle.terminate().code(), Some(0));
}

impl Server {
    fn terminate_wait(&mut self) -> ExitStatus {
        self.child.take().unwrap().wait().unwrap()
    }
}

/// Provider effects of one intent of agent_ana's (`create_refund` under `key`).
fn effects_of(f: &Fixture, key: &str) -> i64 {
    let intent = crate::invariants::intent("acme", "agent_ana", "create_refund", key);
    f.query_i64(&format!("SELECT count(*) FROM provider_effects WHERE intent = '{intent}'"))
}

fn duplicates(f: &Fixture) -> i64 {
    f.engine().counts().unwrap().side_effect_duplicates
}

/// The answers an API call may get when the server's own outbox worker
/// claims its operation first (the race described at
/// `two_hundred_concurrent_dispatches_each_run_exactly_once`): still in
/// flight (409), unknown (504), or the worker's success as a replay.
fn raced_or_fresh(a: &Answer) -> bool {
    matches!(
        (a.status, a.code(), a.delivery()),
        (200, None, "fresh" | "local_replay") | (409 | 504, Some("OUTCOME_UNKNOWN"), _)
    )
}

/// Follows an answer the way its envelope says until it settles: 409 in
/// flight → wait Retry-After and retry the intent with the same key; 504
/// unknown → a status query. Any other answer is returned as it is.
fn settle(c: &Client, token: &str, key: &str, args: &str, first: Answer) -> Answer {
    let mut a = first;
    for _ in 0..60 {
        match (a.status, a.code()) {
            (409, Some("OUTCOME_UNKNOWN")) => {
                let secs = a.retry_after.as_deref().and_then(|s| s.parse::<u64>().ok());
                let secs = secs.unwrap_or_else(|| panic!("409 without Retry-After: {:#}", a.body));
                std::thread::sleep(Duration::from_secs(secs.max(1)));
                a = c.call(token, "create_refund", Some(key), args, &[]);
            }
            (504, Some("OUTCOME_UNKNOWN")) => {
                let q = json!({"status_ref": a.status_ref(), "expected_request_sha256": a.request_sha256()});
                return c.post_json(token, "/v1/status-queries", &q);
            }
            _ => return a,
        }
    }
    a
}

/// Scenario 5 of docs/design.md §13 through the API: a refund above acme's
/// threshold is held as an approval request (202); refusals by operators who
/// may not decide it run nothing; a denial is final for the intent; an allowed
/// operator's approval runs the held call once, and a replay needs no new
/// approval. The expiry boundary itself is the next test.
fn scenario_5_approvals_through_the_api(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let alice_agent = agent_token(f.path(), "acme", "alice");
    let alice = operator_token(f.path(), "alice");
    let bob = operator_token(f.path(), "bob");
    let mallory = operator_token(f.path(), "mallory");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let approve = |op: &str, id: &str| c.post_json(op, &format!("/v1/approvals/{id}/approve"), &json!({}));
    let deny = |op: &str, id: &str| c.post_json(op, &format!("/v1/approvals/{id}/deny"), &json!({"note": "voucher"}));
    let invalid = |a: &Answer, why: &str| {
        assert_eq!(
            (a.status, a.code(), a.outcome()),
            (403, Some("APPROVAL_INVALID"), "not_started"),
            "{why}: {:#}",
            a.body
        );
        assert_eq!(a.body["model_result"]["data"], Value::Null, "{why}");
    };

    // 600 EUR is above acme's 500 EUR threshold: held, nothing accepted.
    let big = refund_args("ord_1002", 60_000);
    let held = c.call(&ana, "create_refund", Some("refund-s5-api-1"), &big, &[]);
    assert_eq!(
        (held.status, held.code(), held.outcome()),
        (202, Some("APPROVAL_REQUIRED"), "not_started"),
        "{:#}",
        held.body
    );
    let first = held.approval_id().to_string();
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 0);
    // The operator's list shows it, with the 15-minute expiry the engine applies.
    let list = c.send("GET", "/v1/approvals", Some(&alice), &[], None);
    let row = list.body["pending"].as_array().unwrap().iter().find(|a| a["approval_id"] == first.as_str()).cloned();
    let row = row.unwrap_or_else(|| panic!("{first} not listed: {:#}", list.body));
    let left = row["expires_in_ms"].as_i64().unwrap();
    // 15 minutes: the engine's fixed approval TTL.
    assert!(left > 0 && left <= 15 * 60_000, "{row:#}");
    assert_eq!(row["amount_minor"], 60_000);
    // Asking again while it is pending: the same request, not a second one.
    let again = c.call(&ana, "create_refund", Some("refund-s5-api-1"), &big, &[]);
    assert_eq!((again.status, again.code(), again.approval_id()), (202, Some("APPROVAL_REQUIRED"), first.as_str()));
    // An approval id that is not this call's is refused.
    let wrong = c.call(&ana, "create_refund", Some("refund-s5-api-1"), &big, &[("toolgate-approval-id", "apr_nope")]);
    invalid(&wrong, "a foreign approval id");

    // Operators who may not decide it: not on acme's allowlist, or the requester itself.
    invalid(&approve(&mallory, &first), "mallory is no approver");
    let own = c.call(&alice_agent, "create_refund", Some("refund-s5-api-own"), &refund_args("ord_2002", 60_000), &[]);
    assert_eq!((own.status, own.code()), (202, Some("APPROVAL_REQUIRED")), "{:#}", own.body);
    invalid(&approve(&alice, own.approval_id()), "alice approving her own request");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 0);
    assert_eq!(effects(&f), 0);

    // bob denies: final. The intent answers APPROVAL_INVALID with the same
    // request (no new one is opened), and a later approval runs nothing.
    let denied = deny(&bob, &first);
    assert_eq!((denied.status, denied.body["applied"].as_bool()), (200, Some(true)), "{:#}", denied.body);
    let after = c.call(&ana, "create_refund", Some("refund-s5-api-1"), &big, &[]);
    invalid(&after, "the intent after the denial");
    assert_eq!(after.approval_id(), first);
    assert_eq!(after.body["model_result"]["error"]["detail"]["reason"], "denied");
    invalid(&approve(&alice, &first), "approving a denied request");
    assert_eq!(deny(&alice, &first).status, 409, "a decided request cannot be denied again");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 0);
    assert_eq!(effects_of(&f, "refund-s5-api-1"), 0);

    // Another intent, approved by an allowed operator: the held call runs once.
    let big2 = refund_args("ord_1002", 70_000);
    let held2 = c.call(&ana, "create_refund", Some("refund-s5-api-2"), &big2, &[]);
    assert_eq!((held2.status, held2.code()), (202, Some("APPROVAL_REQUIRED")));
    assert_ne!(held2.approval_id(), first);
    let ran = approve(&alice, held2.approval_id());
    assert!(raced_or_fresh(&ran), "{:#}", ran.body);
    let ran = settle(&c, &ana, "refund-s5-api-2", &big2, ran);
    assert_eq!((ran.status, ran.code(), ran.outcome()), (200, None, "committed"), "{:#}", ran.body);
    assert_eq!(ran.body["model_result"]["data"]["amount_minor"], 70_000);
    let replay = c.call(&ana, "create_refund", Some("refund-s5-api-2"), &big2, &[]);
    assert_eq!((replay.status, replay.delivery()), (200, "local_replay"), "a replay needs no new approval");
    assert_eq!(replay.refund_id(), ran.refund_id());
    invalid(&approve(&bob, held2.approval_id()), "approving twice");
    assert_eq!(effects_of(&f, "refund-s5-api-2"), 1);

    // bob approves alice's own request: it runs, once.
    let theirs = approve(&bob, own.approval_id());
    assert!(raced_or_fresh(&theirs), "{:#}", theirs.body);
    let theirs = settle(&c, &alice_agent, "refund-s5-api-own", &refund_args("ord_2002", 60_000), theirs);
    assert_eq!((theirs.status, theirs.code()), (200, None), "{:#}", theirs.body);
    assert_eq!(effects(&f), 2);
    assert_eq!(duplicates(&f), 0);
    let ord = f.query_i64("SELECT refunded_minor FROM orders WHERE order_ref = 'ord_1002'");
    assert_eq!(ord, 70_000, "only the approved intent refunded ord_1002");
}

/// Scenario 5's expiry boundary through the API. Each step runs in a new
/// `serve` process on the same ledger whose clock is fixed with the global
/// `--now`: two refunds are held at T; at T + 15 min − 1 ms an approval runs
/// its call once; at exactly T + 15 min (expiry is exclusive) the other is
/// APPROVAL_INVALID, runs nothing, and the same intent opens a new request.
fn an_approval_expires_exactly_at_its_boundary_over_http(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let alice = operator_token(f.path(), "alice");
    let (key1, key2) = ("refund-expiry-api-1", "refund-expiry-api-2");
    let (big1, big2) = (refund_args("ord_1002", 60_000), refund_args("ord_1002", 70_000));
    let at = |now: &str| Server::start(f.path(), &["--now", now]);

    let mut server = at("2031-03-01T12:00:00Z");
    let c = Client::new(&server);
    let held1 = c.call(&ana, "create_refund", Some(key1), &big1, &[]);
    let held2 = c.call(&ana, "create_refund", Some(key2), &big2, &[]);
    for h in [&held1, &held2] {
        assert_eq!((h.status, h.code()), (202, Some("APPROVAL_REQUIRED")), "{:#}", h.body);
    }
    let (first, second) = (held1.approval_id().to_string(), held2.approval_id().to_string());
    let list = c.send("GET", "/v1/approvals", Some(&alice), &[], None);
    let row = list.body["pending"].as_array().unwrap().iter().find(|a| a["approval_id"] == first.as_str()).cloned();
    assert_eq!(row.unwrap()["expires_in_ms"], 15 * 60_000, "{:#}", list.body);
    assert!(server.terminate().success());

    // One millisecond before the expiry: the approval holds and the call runs once.
    let mut server = at("2031-03-01T12:14:59.999Z");
    let c = Client::new(&server);
    let list = c.send("GET", "/v1/approvals", Some(&alice), &[], None);
    let row = list.body["pending"].as_array().unwrap().iter().find(|a| a["approval_id"] == first.as_str()).cloned();
    assert_eq!(row.unwrap()["expires_in_ms"], 1, "{:#}", list.body);
    let ran = c.post_json(&alice, &format!("/v1/approvals/{first}/approve"), &json!({}));
    assert!(raced_or_fresh(&ran), "{:#}", ran.body);
    let ran = settle(&c, &ana, key1, &big1, ran);
    assert_eq!((ran.status, ran.code(), ran.outcome()), (200, None, "committed"), "{:#}", ran.body);
    assert!(server.terminate().success());

    // At exactly the expiry instant: refused, nothing runs, and asking again
    // opens a new request instead of reviving the expired one.
    let server = at("2031-03-01T12:15:00Z");
    let c = Client::new(&server);
    let late = c.post_json(&alice, &format!("/v1/approvals/{second}/approve"), &json!({}));
    assert_eq!(
        (late.status, late.code(), late.outcome()),
        (403, Some("APPROVAL_INVALID"), "not_started"),
        "{:#}",
        late.body
    );
    let again = c.call(&ana, "create_refund", Some(key2), &big2, &[]);
    assert_eq!((again.status, again.code()), (202, Some("APPROVAL_REQUIRED")), "{:#}", again.body);
    assert_ne!(again.approval_id(), second, "an expired request is never revived");
    assert_eq!((effects_of(&f, key1), effects_of(&f, key2)), (1, 0));
    assert_eq!(duplicates(&f), 0);
}

/// Scenario 6 of docs/design.md §13 through the API: the grant is revoked
/// (`toolgate revoke` on the ledger while the server runs) between a refund and
/// its retry. The replay is POLICY_DENIED with no cached data and no
/// status_ref, the status query is refused too, another subject holding the
/// status_ref gets NOT_FOUND, and once the grant is back the record is intact.
fn scenario_6_a_revoked_grant_hides_the_stored_result(backend: Backend) {
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let ben = agent_token(f.path(), "acme", "agent_ben");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let args = refund_args("ord_1001", 1000);
    let grant = |what: &str| {
        let out = Command::new(bin())
            .arg("--db")
            .arg(f.path())
            .args([what, "--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["changed"], true, "{what}: {v}");
    };

    let first = c.call(&ana, "create_refund", Some("refund-s6-api-1"), &args, &[]);
    assert_eq!((first.status, first.delivery()), (200, "fresh"), "{:#}", first.body);
    let query = json!({"status_ref": first.status_ref(), "expected_request_sha256": first.request_sha256()});

    grant("revoke");
    let denied = c.call(&ana, "create_refund", Some("refund-s6-api-1"), &args, &[("toolgate-call-id", "call_retry")]);
    assert_eq!(
        (denied.status, denied.code(), denied.outcome()),
        (403, Some("POLICY_DENIED"), "not_started"),
        "{:#}",
        denied.body
    );
    assert_eq!(denied.body["model_result"]["data"], Value::Null, "no cached data");
    assert_eq!(denied.body["protected_audit"]["downstream"]["status_ref"], Value::Null, "no status_ref");
    assert!(!denied.body.to_string().contains(first.refund_id()), "the refund id leaked: {}", denied.body);
    let q = c.post_json(&ana, "/v1/status-queries", &query);
    assert_eq!((q.status, q.code()), (403, Some("POLICY_DENIED")), "{:#}", q.body);
    assert_eq!(q.body["model_result"]["data"], Value::Null);
    let op = c.send("GET", &format!("/v1/operations/{}", first.operation_id()), Some(&ana), &[], None);
    assert_eq!((op.status, op.code()), (403, Some("POLICY_DENIED")), "{:#}", op.body);
    assert!(!op.body.to_string().contains(first.refund_id()), "GET /v1/operations leaked the result: {:#}", op.body);
    // A status_ref is not a bearer token: another subject learns nothing.
    let other = c.post_json(&ben, "/v1/status-queries", &query);
    assert_eq!((other.status, other.code()), (404, Some("NOT_FOUND")), "{:#}", other.body);
    assert_eq!(other.body["model_result"]["data"], Value::Null);

    grant("grant");
    let back = c.call(&ana, "create_refund", Some("refund-s6-api-1"), &args, &[]);
    assert_eq!((back.status, back.delivery()), (200, "local_replay"), "{:#}", back.body);
    assert_eq!(back.refund_id(), first.refund_id());
    assert_eq!(effects_of(&f, "refund-s6-api-1"), 1);
    assert_eq!((effects(&f), duplicates(&f)), (1, 0));
}

/// Scenario 7 of docs/design.md §13 through the API, with the provider's 429
/// asked for in `Toolgate-Fault` (a demo ledger). Within the deadline the
/// engine waits out Retry-After and retries: one refund, two attempts. When
/// Retry-After reaches past the caller's deadline (`Toolgate-Deadline-Ms`),
/// the answer is HTTP 429 with Retry-After and `RATE_LIMIT` with
/// `retry_after_ms`, nothing done; a retry before that time is told to wait,
/// one after it runs once, and the next is a replay.
fn scenario_7_rate_limited_through_the_api(backend: Backend) {
    let f = Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let attempts =
        |a: &Answer| f.query_i64(&format!("SELECT count(*) FROM attempts WHERE operation_id = '{}'", a.operation_id()));

    // Retry-After 1 s within the default 30 s deadline: retried inside the call.
    let args1 = refund_args("ord_1001", 1000);
    let within =
        c.call(&ana, "create_refund", Some("refund-s7-api-1"), &args1, &[("toolgate-fault", "rate_limit(1000),ok")]);
    // The retry falls due in the outbox while the call waits: the server's
    // own worker may send it first (then the answer is the race's, settled).
    assert!(raced_or_fresh(&within), "{:#}", within.body);
    let within = settle(&c, &ana, "refund-s7-api-1", &args1, within);
    assert_eq!((within.status, within.code(), within.outcome()), (200, None, "committed"), "{:#}", within.body);
    assert_eq!(attempts(&within), 2);
    assert_eq!(effects_of(&f, "refund-s7-api-1"), 1);

    // Retry-After 5 s, deadline 2 s: the caller is told when to come back.
    let args2 = refund_args("ord_1001", 500);
    let deadline = ("toolgate-deadline-ms", "2000");
    let limited = c.call(
        &ana,
        "create_refund",
        Some("refund-s7-api-2"),
        &args2,
        &[deadline, ("toolgate-fault", "rate_limit(5000)")],
    );
    assert_eq!(
        (limited.status, limited.code(), limited.outcome()),
        (429, Some("RATE_LIMIT"), "not_started"),
        "{:#}",
        limited.body
    );
    assert_eq!(limited.body["model_result"]["error"]["retryable"], true);
    assert_eq!(limited.retry_after_ms(), Some(5000), "{:#}", limited.body);
    assert_eq!(limited.retry_after.as_deref(), Some("5"), "Retry-After in whole seconds, rounded up");
    assert_eq!(effects_of(&f, "refund-s7-api-2"), 0);
    let early = c.call(&ana, "create_refund", Some("refund-s7-api-2"), &args2, &[deadline]);
    assert_eq!((early.status, early.code()), (429, Some("RATE_LIMIT")), "{:#}", early.body);
    let wait = early.retry_after_ms().unwrap();
    assert!(wait > 0 && wait <= 5000, "{wait}");
    assert!(early.retry_after.as_deref().is_some_and(|s| s.parse::<u64>().is_ok_and(|s| (1..=5).contains(&s))));
    assert_eq!((attempts(&early), effects_of(&f, "refund-s7-api-2")), (1, 0), "nothing was sent again");

    // After Retry-After (the server's own worker leaves it: its deadline has
    // passed, and only a new call refreshes it): runs once, then replays.
    let mut answer = early;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(answer.retry_after_ms().unwrap_or(0) + 50));
        answer = c.call(&ana, "create_refund", Some("refund-s7-api-2"), &args2, &[deadline]);
        if answer.status != 429 {
            break;
        }
    }
    assert_eq!((answer.status, answer.code(), answer.delivery()), (200, None, "fresh"), "{:#}", answer.body);
    assert_eq!(attempts(&answer), 2);
    let replay = c.call(&ana, "create_refund", Some("refund-s7-api-2"), &args2, &[]);
    assert_eq!((replay.status, replay.delivery()), (200, "local_replay"));
    assert_eq!(replay.refund_id(), answer.refund_id());
    assert_eq!(effects_of(&f, "refund-s7-api-2"), 1);
    assert_eq!((effects(&f), duplicates(&f)), (2, 0));
    assert_eq!(f.query_i64("SELECT refunded_minor FROM orders WHERE order_ref = 'ord_1001'"), 1500);
}

/// 200 connections at once, each a real dispatch (issue 17 §5): 200 callers,
/// each on its own connection, POST a create_refund of 0.01 EUR under a key
/// of its own at the same moment. Every answer is an envelope, and each is
/// followed the way its envelope says:
/// - 503 `SERVER_BUSY` with Retry-After (the engine threads' queue is full,
///   nothing was done): wait, retry with the same key;
/// - 409 `OUTCOME_UNKNOWN` with Retry-After (in flight): wait, retry;
/// - 504 `OUTCOME_UNKNOWN` (`query_status`): a status query.
///
/// The last two, and a success delivered as `local_replay` to the call that
/// created the operation, come from one race under this load: the server's
/// own outbox worker can claim an operation an API thread has just accepted
/// before that thread claims it (the worker then runs it; one effect either
/// way). They are counted, not forbidden; anything else is. In the end every
/// caller holds a success with its own refund, every intent has exactly one
/// effect and one succeeded operation, nothing is duplicated, the server still
/// answers and stops cleanly, and the ledger keeps every invariant.
fn two_hundred_concurrent_dispatches_each_run_exactly_once(backend: Backend) {
    const CALLERS: usize = 200;
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let mut server = Server::start(f.path(), &[]);
    let clients: Vec<Client> = (0..CALLERS).map(|_| Client::new(&server)).collect();
    let start = std::sync::Barrier::new(CALLERS);
    // Per caller: (SERVER_BUSY answers, answers from the worker race, the final answer).
    let answers: Vec<(u32, u32, Answer)> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let (ana, start) = (&ana, &start);
                s.spawn(move || {
                    let key = format!("refund-c200-{i:04}");
                    let args = refund_args("ord_1002", 1);
                    start.wait();
                    let (mut busy, mut raced) = (0, 0);
                    loop {
                        let a = c.call(ana, "create_refund", Some(&key), &args, &[]);
                        match (a.status, a.code()) {
                            (503, Some("SERVER_BUSY")) => {
                                assert_eq!(a.outcome(), "not_started", "{key}: {:#}", a.body);
                                assert_eq!(a.body["model_result"]["error"]["retryable"], true);
                                busy += 1;
                            }
                            (409, Some("OUTCOME_UNKNOWN")) => raced += 1,
                            (504, Some("OUTCOME_UNKNOWN")) => {
                                assert_eq!(a.body["model_result"]["error"]["recovery"], "query_status");
                                let q = json!({"status_ref": a.status_ref(), "expected_request_sha256": a.request_sha256()});
                                return (busy, raced + 1, c.post_json(ana, "/v1/status-queries", &q));
                            }
                            _ => {
                                let late = u32::from(a.delivery() != "fresh");
                                return (busy, raced + late, a);
                            }
                        }
                        let secs: u64 = a.retry_after.as_deref().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
                            panic!("{key}: {} without a Retry-After in seconds: {:#}", a.status, a.body)
                        });
                        assert!(busy + raced < 60, "{key}: not settled after {busy} busy, {raced} in flight");
                        std::thread::sleep(Duration::from_secs(secs.max(1)));
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut refunds = std::collections::BTreeSet::new();
    for (i, (_, _, a)) in answers.iter().enumerate() {
        assert_eq!((a.status, a.code()), (200, None), "caller {i}: {:#}", a.body);
        assert_eq!(a.body["model_result"]["data"]["amount_minor"], 1, "caller {i}");
        assert!(refunds.insert(a.refund_id().to_string()), "caller {i} got another caller's refund");
    }
    let busy: u32 = answers.iter().map(|(b, _, _)| b).sum();
    let raced: u32 = answers.iter().map(|(_, r, _)| r).sum();
    eprintln!(
        "{CALLERS} concurrent dispatches: {busy} SERVER_BUSY answers retried, {raced} answers from the worker race"
    );
    for i in [0, CALLERS / 2, CALLERS - 1] {
        assert_eq!(effects_of(&f, &format!("refund-c200-{i:04}")), 1);
    }
    let n = i64::try_from(CALLERS).unwrap();
    assert_eq!((effects(&f), duplicates(&f)), (n, 0));
    assert_eq!(f.query_i64("SELECT count(*) FROM operations WHERE state = 'succeeded'"), n);
    assert_eq!(f.query_i64("SELECT refunded_minor FROM orders WHERE order_ref = 'ord_1002'"), n);
    let health = Client::new(&server).send("GET", "/healthz", None, &[], None);
    assert_eq!(health.status, 200);
    assert_eq!(server.terminate().code(), Some(0));
    let (violations, tally) =
        crate::invariants::check(f.path(), crate::invariants::Expect { settled: true, queried: false });
    assert!(violations.is_empty(), "{violations:#?}");
    assert_eq!(tally.effects, n);
}

/// `?project=` (docs/design.md §17): only the model result, as one provider's tool
/// result for the request's call id, with the envelope's status; the
/// protected audit never appears; a bad name or parameter is 400 before any state.
fn projections_render_the_model_result_only(backend: Backend) {
    let f = Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let args = refund_args("ord_1001", 1000);
    let call_id = [("toolgate-call-id", "call_abc")];
    let path = |p: &str| format!("/v1/tools/create_refund/calls?project={p}");
    let send = |p: &str, key: &str, args: &str, extra: &[(&str, &str)]| {
        let mut h = vec![("content-type", "application/json"), ("idempotency-key", key)];
        h.extend_from_slice(extra);
        c.send("POST", &path(p), Some(&ana), &h, Some(args.as_bytes()))
    };

    // A success as an OpenAI Responses item; its output is the model result exactly.
    let ok = send("openai-responses", "refund-proj-0001", &args, &call_id);
    assert_eq!(ok.status, 200, "{:#}", ok.body);
    assert_eq!(ok.body["type"], "function_call_output");
    assert_eq!(ok.body["call_id"], "call_abc");
    let inner: Value = serde_json::from_str(ok.body["output"].as_str().unwrap()).unwrap();
    assert_eq!(inner["status"], "succeeded");
    assert_eq!(inner["execution"]["delivery"], "fresh");
    assert!(inner.get("protected_audit").is_none() && ok.body.get("protected_audit").is_none());
    let full = c.call(&ana, "create_refund", Some("refund-proj-0001"), &args, &[]);
    assert_eq!(full.delivery(), "local_replay");
    assert_eq!(inner["data"], full.body["model_result"]["data"]);

    // A conflict as an Anthropic tool_result: the envelope's 422, is_error.
    let conflict =
        send("anthropic", "refund-proj-0001", &refund_args("ord_1001", 1500), &[("toolgate-call-id", "toolu_9")]);
    assert_eq!(conflict.status, 422, "{:#}", conflict.body);
    assert_eq!(
        (conflict.body["tool_use_id"].as_str(), conflict.body["is_error"].as_bool()),
        (Some("toolu_9"), Some(true))
    );
    let text: Value = serde_json::from_str(conflict.body["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(text["error"]["code"], "IDEMPOTENCY_CONFLICT");

    // A lost reply as a Gemini functionResponse: 504, unknown, and nothing of the audit.
    let lost_args = refund_args("ord_1004", 700);
    let lost = c.call(
        &ana,
        "create_refund",
        Some("refund-proj-lost"),
        &lost_args,
        &[("toolgate-fault", "timeout_after_commit")],
    );
    assert_eq!(lost.code(), Some("OUTCOME_UNKNOWN"));
    let again = send("gemini", "refund-proj-lost", &lost_args, &[]);
    assert_eq!(again.status, 504, "{:#}", again.body);
    assert_eq!(again.body["functionResponse"]["name"], "create_refund");
    assert_eq!(again.body["functionResponse"]["response"]["error"]["code"], "OUTCOME_UNKNOWN");
    let shown = again.body.to_string();
    for secret in [lost.status_ref(), lost.request_sha256(), lost.operation_id()] {
        assert!(!shown.contains(secret), "{secret} leaked into {shown}");
    }

    // The status query as an OpenAI Chat tool message.
    let q = c.send(
        "POST",
        "/v1/status-queries?project=openai-chat",
        Some(&ana),
        &[("content-type", "application/json"), ("toolgate-call-id", "call_q1")],
        Some(
            json!({"status_ref": lost.status_ref(), "expected_request_sha256": lost.request_sha256()})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(q.status, 200, "{:#}", q.body);
    assert_eq!((q.body["role"].as_str(), q.body["tool_call_id"].as_str()), (Some("tool"), Some("call_q1")));
    let content: Value = serde_json::from_str(q.body["content"].as_str().unwrap()).unwrap();
    assert_eq!(content["execution"]["delivery"], "receipt_reconciled");

    // Refusals before any state: an unknown name, another parameter, `project` twice.
    let before = business_snapshot(&f);
    for (query, code) in [
        ("project=openai", "UNKNOWN_PROJECTION"),
        ("project=", "UNKNOWN_PROJECTION"),
        ("projection=gemini", "INVALID_QUERY"),
        ("project=gemini&project=anthropic", "INVALID_QUERY"),
    ] {
        let h = [("content-type", "application/json"), ("idempotency-key", "refund-proj-refused")];
        let r =
            c.send("POST", &format!("/v1/tools/create_refund/calls?{query}"), Some(&ana), &h, Some(args.as_bytes()));
        assert_eq!((r.status, r.code()), (400, Some(code)), "{query}: {:#}", r.body);
    }
    assert_eq!(business_snapshot(&f), before);
    assert_eq!(effects(&f), 2);
}

/// The README's code -> status table names every code with the status the server uses.
#[test]
fn the_readme_table_matches_the_status_mapping() {
    use toolgate::api::status;
    use toolgate::engine::envelope::Code;
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let row_of = |code: &str| {
        readme
            .lines()
            .find(|l| l.split('|').nth(1).is_some_and(|first| first.contains(&format!("`{code}`"))))
            .unwrap_or_else(|| panic!("README's status table lacks {code}"))
            .to_string()
    };
    for c in Code::ALL {
        let row = row_of(c.as_str());
        let statuses: Vec<u16> =
            [None, Some(toolgate::store::OpState::InFlight), Some(toolgate::store::OpState::Unknown)]
                .iter()
                .map(|s| status::of_code(c, *s).as_u16())
                .collect();
        for st in statuses {
            assert!(row.contains(&st.to_string()), "README row for {c} lacks {st}: {row}");
        }
    }
    for c in status::ALL {
        let row = row_of(c.code);
        assert!(row.contains(&c.status.as_u16().to_string()), "README row for {} lacks {}: {row}", c.code, c.status);
    }
    for code in ["TOKEN_MISSING", "TOKEN_MALFORMED", "TOKEN_UNKNOWN", "TOKEN_EXPIRED", "TOKEN_REVOKED"] {
        assert!(row_of(code).contains("401"));
    }
}

crate::on_both_backends!(
    fresh_dispatch_replay_conflict_and_missing_key,
    a_lost_reply_is_unknown_until_a_status_query_reconciles_it,
    the_same_key_while_in_flight_is_409_with_retry_after,
    tokens_are_checked_at_every_request_and_never_stored,
    other_callers_ids_are_404_and_agents_cannot_act_as_operators,
    hostile_requests_get_stable_codes_and_change_nothing,
    an_identity_header_sent_twice_is_refused_and_changes_nothing,
    sigterm_lets_the_call_in_flight_finish_and_exits_0,
    projections_render_the_model_result_only,
    scenario_5_approvals_through_the_api,
    scenario_6_a_revoked_grant_hides_the_stored_result,
    scenario_7_rate_limited_through_the_api,
    two_hundred_concurrent_dispatches_each_run_exactly_once,
);

/// `toolgate load --url A --url B` (issue 17 §5): the agents go through the
/// HTTP API of two `serve` replicas on one ledger, each call to either, with
/// random faults (5%) in a header; the referee finds 0 duplicates and 0
/// silently wrong results, both replicas served calls, and the run's tokens
/// are revoked at its end.
fn the_load_generator_through_two_serve_replicas(backend: Backend) {
    let f = Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let mut a = Server::start(f.path(), &[]);
    let mut b = Server::start(f.path(), &[]);
    let out = Command::new(bin())
        .arg("--db")
        .arg(f.path())
        .args(["load", "--agents", "3", "--ops", "60", "--fault-rate", "5%", "--seed", "5", "--json"])
        .args(["--url", &a.url, "--url", &b.url])
        .output()
        .unwrap();
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report["ops"], 60, "{report}");
    assert_eq!(report["duplicates"], 0, "{report}");
    assert_eq!(report["silently_wrong"], 0, "{report}");
    assert!(report["effects"].as_i64().unwrap() > 0, "{report}");
    for s in [&a, &b] {
        let served =
            f.query_i64(&format!("SELECT count(*) FROM trace_events WHERE fields LIKE '%serve-{}-api%'", s.pid()));
        assert!(served > 0, "replica {} served no call", s.url);
    }
    assert_eq!(f.query_i64("SELECT count(*) FROM api_tokens WHERE name LIKE 'load-%' AND revoked_at IS NULL"), 0);
    assert!(f.query_i64("SELECT count(*) FROM api_tokens WHERE name LIKE 'load-%'") >= 6);
    assert_eq!(a.terminate().code(), Some(0));
    assert_eq!(b.terminate().code(), Some(0));
}

/// Issue 33 Medium 6: every unauthenticated request wrote a durable trace
/// row (~117 B, ~1,570/s from one client, never pruned). Counted in memory
/// and in the metrics; the ledger keeps a sample of at most one a second.
#[test]
fn a_flood_of_bad_tokens_is_counted_not_stored() {
    let f = Fixture::new();
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let started = std::time::Instant::now();
    for i in 0..300 {
        let a = c.send(
            "POST",
            "/v1/tools/get_order/calls",
            Some(&format!("tgt_bogus{i:04}")),
            &[("content-type", "application/json")],
            Some(br#"{"order_ref":"ord_1001"}"#),
        );
        assert_eq!(a.status, 401);
    }
    let seconds = started.elapsed().as_secs() as i64;
    let rows = f.query_i64("SELECT count(*) FROM trace_events WHERE step = 'authentication'");
    assert!(rows >= 1 && rows <= seconds + 2, "{rows} rows for 300 refusals in {seconds} s");
    let mut r = ureq::get(&format!("{}/metrics", server.url)).call().unwrap();
    let text = r.body_mut().read_to_string().unwrap();
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("toolgate_auth_refusals_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(counted >= 300.0, "{counted}:\n{text}");
}

/// Issue 33 Medium 5: a caller's deadline started when an engine thread took
/// the call, so calls queued behind slow ones ran up to 27 s late. It counts
/// from the request's arrival: a new call whose deadline passed in the queue
/// is TIMEOUT_BEFORE_EXECUTE and not accepted (no operation, nothing sent).
#[test]
fn a_deadline_counts_from_arrival_and_a_call_that_spent_it_queued_is_not_accepted() {
    let f = Fixture::new();
    f.engine().mark_demo(crate::support::T0).unwrap();
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let server = Server::start(f.path(), &[]);
    let c = std::sync::Arc::new(Client::new(&server));
    // Both engine threads busy for 2.5 s.
    let slow: Vec<_> = (0..2)
        .map(|i| {
            let (c, ana) = (c.clone(), ana.clone());
            std::thread::spawn(move || {
                let args = refund_args("ord_1001", 100 + i);
                c.call(
                    &ana,
                    "create_refund",
                    Some(&format!("refund-slow-{i:04}")),
                    &args,
                    &[("toolgate-fault", "latency(2500)")],
                )
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let args = refund_args("ord_1002", 300);
    let late = c.call(&ana, "create_refund", Some("refund-queued-0001"), &args, &[("toolgate-deadline-ms", "800")]);
    assert_eq!(late.code(), Some("TIMEOUT_BEFORE_EXECUTE"), "{:#}", late.body);
    assert_eq!(late.body["model_result"]["execution"]["outcome"], "not_started");
    for s in slow {
        assert_eq!(s.join().unwrap().code(), None, "the slow calls succeed");
    }
    assert_eq!(f.query_i64("SELECT count(*) FROM operations WHERE idem_key = 'refund-queued-0001'"), 0, "not accepted");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 2);
    // The same key later, in time: it runs once.
    let again = c.call(&ana, "create_refund", Some("refund-queued-0001"), &args, &[]);
    assert_eq!(again.code(), None, "{:#}", again.body);
}

/// Issue 33 Medium 9: `load` stopped with exit 2 and no report at the first
/// killed replica. A harness survives its target's faults: a call that cannot
/// reach a replica is made again with the same key (on whichever replica the
/// balancer picks), counted, and the run ends with its report.
#[test]
fn the_load_generator_survives_a_killed_replica_and_reports() {
    let f = Fixture::new();
    f.engine().mark_demo(crate::support::T0).unwrap();
    let mut a = Server::start(f.path(), &[]);
    let mut b = Server::start(f.path(), &[]);
    let dead = b.url.clone();
    b.kill();
    let out = Command::new(bin())
        .arg("--db")
        .arg(f.path())
        .args(["load", "--agents", "2", "--ops", "30", "--seed", "9", "--json"])
        .args(["--url", &a.url, "--url", &dead])
        .output()
        .unwrap();
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report["ops"], 30, "{report}");
    assert!(report["transport_errors"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["duplicates"], 0, "{report}");
    assert_eq!(report["silently_wrong"], 0, "{report}");
    assert_eq!(a.terminate().code(), Some(0));
}

crate::on_both_backends!(the_load_generator_through_two_serve_replicas);
crate::on_both_backends!(an_approval_expires_exactly_at_its_boundary_over_http);

/// `serve` listens on loopback unless told `--public`: a wider address is
/// refused before anything binds (TEST-NET-1, which no interface here holds,
/// so a lost refusal could not listen beyond this machine either).
#[test]
fn serve_refuses_a_non_loopback_address_unless_told() {
    let f = Fixture::new();
    let out =
        Command::new(bin()).arg("--db").arg(f.path()).args(["serve", "--listen", "192.0.2.1:0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("error[NOT_LOOPBACK]") && err.contains("--public"), "{err}");
}

/// Issue 33 Medium 4: an operator on no tenant's approver list read every
/// tenant's operations and approvals and resolved another tenant's refund.
/// An operator token reaches only its tenants; everything else is as if it
/// did not exist.
fn an_operator_token_reaches_only_its_tenants(backend: Backend) {
    let f = Fixture::on(backend);
    let server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let gus = agent_token(f.path(), "globex", "agent_gus");
    let acme_only = scoped_operator_token(f.path(), "alice", &["acme"]);
    // A pending approval in each tenant, and an unknown operation in globex.
    let big_acme = c.call(&ana, "create_refund", Some("scope-big-acme-1"), &refund_args("ord_1002", 120_000), &[]);
    assert_eq!(big_acme.code(), Some("APPROVAL_REQUIRED"), "{:#}", big_acme.body);
    let gus_args = r#"{"order_ref":"ord_3001","amount_minor":25000,"currency":"GBP","reason":"damaged"}"#;
    let big_globex = c.call(&gus, "create_refund", Some("scope-big-glob-1"), gus_args, &[]);
    assert_eq!(big_globex.code(), Some("APPROVAL_REQUIRED"), "{:#}", big_globex.body);
    let listed = c.send("GET", "/v1/approvals", Some(&acme_only), &[], None);
    let ids: Vec<&str> =
        listed.body["pending"].as_array().unwrap().iter().map(|a| a["approval_id"].as_str().unwrap()).collect();
    assert_eq!(ids, [big_acme.approval_id()], "only acme's: {:#}", listed.body);
    // Another tenant's approval: not there (and its approval stays pending).
    let other = big_globex.approval_id().to_string();
    let a = c.post_json(&acme_only, &format!("/v1/approvals/{other}/approve"), &serde_json::json!({}));
    assert_eq!(a.code(), Some("APPROVAL_INVALID"), "{:#}", a.body);
    assert_eq!(a.body["model_result"]["error"]["detail"]["reason"], "no such approval request", "{:#}", a.body);
    assert_eq!(f.query_i64(&format!("SELECT count(*) FROM approvals WHERE id = '{other}' AND state = 'pending'")), 1);
    // Another tenant's operation: 404 on read, no such operation on resolve.
    let lost = c.call(
        &gus,
        "create_refund",
        Some("scope-lost-glob-1"),
        r#"{"order_ref":"ord_3001","amount_minor":100,"currency":"GBP","reason":"damaged"}"#,
        &[],
    );
    let op = lost.operation_id().to_string();
    let read = c.send("GET", &format!("/v1/operations/{op}"), Some(&acme_only), &[], None);
    assert_eq!(read.status, 404, "{:#}", read.body);
    let resolved = c.post_json(
        &acme_only,
        &format!("/v1/operations/{op}/resolve"),
        &serde_json::json!({"resolution": "compensated", "note": "not mine", "against_evidence": true}),
    );
    assert_eq!(resolved.status, 409, "{:#}", resolved.body);
    assert!(resolved.body.to_string().contains("no such operation"), "{:#}", resolved.body);
    // Its own tenant works.
    let own =
        c.post_json(&acme_only, &format!("/v1/approvals/{}/approve", big_acme.approval_id()), &serde_json::json!({}));
    assert_eq!(own.code(), None, "{:#}", own.body);
    // An all-tenants token still reaches globex.
    let root = operator_token(f.path(), "bob");
    let read = c.send("GET", &format!("/v1/operations/{op}"), Some(&root), &[], None);
    assert_eq!(read.status, 200, "{:#}", read.body);
}

crate::on_both_backends!(an_operator_token_reaches_only_its_tenants);

/// A ledger written before operator tokens had tenants (schema 15) opens,
/// migrates and audits clean, and its operator token keeps reaching every
/// tenant (an upgrade changes no token's reach).
#[test]
fn a_version_15_ledger_keeps_its_operator_token_reaching_every_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v15.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v15.db"), &path).unwrap();
    let v: i64 = crate::support::raw(&path).query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 15);
    let clock = toolgate::engine::clock::ManualClock::new(crate::support::T0);
    let mut e = toolgate::engine::Engine::open(&path, crate::support::opts(&clock, "migrate")).unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    // The fixture's operator token (made by `--operator kim token create` at schema 15).
    let old = b"Bearer tgt_3c7855941b8dcb24_-xSsC_MAlHVxbHNtwAwkE0XzfTPS2NQCj2sXofMCZXU";
    match e.authenticate(Some(old)).unwrap() {
        Ok(toolgate::engine::tokens::Principal::Operator { operator, tenants, .. }) => {
            assert_eq!((operator.as_str(), tenants), ("kim", None));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.list_operations(None, 10).unwrap().len(), 1, "the fixture's refund is still there");
}

/// A connection to `addr` from another loopback address (`from`: another
/// client, as the server sees it).
fn connect_from(from: [u8; 4], addr: &str) -> std::io::Result<TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(std::net::SocketAddr::from((from, 0)))?;
        let stream = socket.connect(addr.parse().map_err(std::io::Error::other)?).await?;
        let std = stream.into_std()?;
        std.set_nonblocking(false)?;
        Ok(std)
    })
}

/// Issue 33 Medium 11 (slowloris): one client holding 3,000 slow connections
/// made `/healthz` probes time out (1,024-connection cap, no per-client
/// limit). Here, on a server capped at 32 connections, one client address
/// keeps 300 connections open, each sending a byte of a request head now and
/// then and reopening whatever closes; another client's probes are answered,
/// and the attacker's connections beyond its 8 are answered 429 at once.
/// Before the per-client limit every probe waited in the accept queue behind
/// the attacker and none was answered within 20 s.
#[test]
fn one_client_holding_slow_connections_cannot_keep_another_out() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let f = Fixture::on(Backend::Sqlite);
    let server = Server::start_serving(f.path(), &["--max-connections", "32", "--max-connections-per-client", "8"]);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (refused_tx, refused) = std::sync::mpsc::channel::<String>();
    let attacker = {
        let (stop, addr) = (stop.clone(), server.addr.clone());
        std::thread::spawn(move || {
            let mut open: Vec<TcpStream> = Vec::new();
            let mut told = false;
            while !stop.load(Ordering::SeqCst) {
                while open.len() < 300 && !stop.load(Ordering::SeqCst) {
                    match connect_from([127, 0, 0, 2], &addr) {
                        Ok(s) => {
                            let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
                            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                            open.push(s);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
                // A byte of a head that never ends, on each; drop what closed.
                open.retain_mut(|s| {
                    let mut buf = [0u8; 512];
                    match s.read(&mut buf) {
                        Ok(0) => false,
                        Ok(n) => {
                            if !told {
                                told = refused_tx.send(String::from_utf8_lossy(&buf[..n]).into_owned()).is_ok();
                            }
                            false
                        }
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                            s.write_all(b"X-Slow: 1\r\n").is_ok()
                        }
                        Err(_) => false,
                    }
                });
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    // Wait until the attacker holds its connections.
    let first = refused.recv_timeout(Duration::from_secs(60)).expect("a connection over the limit is answered");
    assert!(first.starts_with("HTTP/1.1 429") && first.contains("TOO_MANY_CONNECTIONS"), "{first}");
    let probe: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into();
    for i in 0..3 {
        let answer = probe.get(&format!("{}/healthz", server.url)).call();
        match answer {
            Ok(r) => assert_eq!(r.status().as_u16(), 200, "probe {i}"),
            Err(e) => panic!("probe {i} was not answered while one client held slow connections: {e}"),
        }
    }
    let metrics = probe.get(&format!("{}/metrics", server.url)).call().unwrap().body_mut().read_to_string().unwrap();
    let refused_total = metrics
        .lines()
        .find_map(|l| l.strip_prefix("toolgate_connections_refused_total "))
        .and_then(|n| n.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no toolgate_connections_refused_total in /metrics"));
    assert!(refused_total >= 1.0, "{refused_total}");
    stop.store(true, Ordering::SeqCst);
    attacker.join().unwrap();
}

/// The demo catalog with `create_refund`'s downstream limited to `n` calls in
/// flight from one process.
fn bulkhead_catalog(dir: &Path, n: u32) -> PathBuf {
    let out = dir.join("bulkhead-catalog");
    std::fs::create_dir_all(&out).unwrap();
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog");
    for entry in std::fs::read_dir(&assets).unwrap() {
        let p = entry.unwrap().path();
        let mut text = std::fs::read_to_string(&p).unwrap();
        if p.file_name().is_some_and(|f| f == "create_refund.json") {
            let mut v: Value = serde_json::from_str(&text).unwrap();
            v["downstream"]["max_in_flight"] = Value::from(n);
            text = v.to_string();
        }
        std::fs::write(out.join(p.file_name().unwrap()), text).unwrap();
    }
    out
}

/// Issue 32 §3: one slow downstream stalled every tool (with 4 engine
/// threads, 12 slow calls ran four at a time and a replay of another tool
/// waited 4.35 s behind them). With the downstream's bulkhead at 1 on a
/// 2-thread server: while one 4-second refund is in flight, a second refund is
/// answered at once TOOL_UNAVAILABLE with a retry hint (not sent, its
/// operation waiting in the outbox), and a read of another tool is answered
/// while the first refund is still in flight. Before: the second refund took
/// the other thread and the read waited for one of them to finish.
fn a_slow_downstream_takes_at_most_its_bulkhead_of_the_engine_threads(backend: Backend) {
    let f = Fixture::on(backend);
    f.engine().mark_demo(crate::support::T0).unwrap();
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let catalog = bulkhead_catalog(f.scratch(), 1);
    let server = Server::start(f.path(), &["--catalog", catalog.to_str().unwrap()]);
    let c = std::sync::Arc::new(Client::new(&server));
    let slow = [("toolgate-fault", "latency(4000)")];
    let first = {
        let (c, ana) = (c.clone(), ana.clone());
        std::thread::spawn(move || {
            c.call(&ana, "create_refund", Some("bulkhead-refund-1"), &refund_args("ord_1001", 300), &slow)
        })
    };
    // The first refund is in flight when its attempt is marked sent.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while f.query_i64("SELECT count(*) FROM attempts WHERE sent_at IS NOT NULL") == 0 {
        assert!(std::time::Instant::now() < deadline, "the first refund was never sent");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = c.call(&ana, "create_refund", Some("bulkhead-refund-2"), &refund_args("ord_1001", 200), &slow);
    assert_eq!((second.status, second.code()), (503, Some("TOOL_UNAVAILABLE")), "{:#}", second.body);
    assert!(second.retry_after_ms().is_some(), "{:#}", second.body);
    assert_eq!(second.body["model_result"]["execution"]["outcome"], "not_started");
    let read = c.call(&ana, "get_order", None, r#"{"order_ref":"ord_1002"}"#, &[]);
    assert_eq!(read.status, 200, "{:#}", read.body);
    assert!(!first.is_finished(), "the read was answered while the slow refund was still in flight");
    let first = first.join().unwrap();
    assert_eq!(first.status, 200, "{:#}", first.body);
    // The second refund's key, retried once the downstream has room: sent once.
    let again = c.call(&ana, "create_refund", Some("bulkhead-refund-2"), &refund_args("ord_1001", 200), &[]);
    assert_eq!(again.status, 200, "{:#}", again.body);
    assert_eq!(effects(&f), 2);
}

crate::on_both_backends!(a_slow_downstream_takes_at_most_its_bulkhead_of_the_engine_threads);
