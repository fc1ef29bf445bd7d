//! The agents' way in when `toolgate load --url` drives `toolgate serve`
//! replicas: every dispatch, approval and status query is a real HTTP
//! request to one of the replicas (picked at random per call, like a load
//! balancer), with a bearer token per principal and per approver that the run
//! mints in the ledger and revokes at its end.
//!
//! The body of every answer is the envelope of docs/design.md §4; a refusal
//! of the server's own (`SERVER_BUSY`, a token refused) is not an engine
//! envelope and becomes what a careful harness makes of it: busy is "retry
//! after", anything else stops the run with its code.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{Buffers, ConnectionDetails, Connector, DefaultConnector, NextTimeout, Transport};

use crate::engine::canonical::CallIdentity;
use crate::engine::envelope::{Code, Envelope};
use crate::engine::tokens::TokenFor;
use crate::engine::{DispatchRequest, Engine, EngineError, QueryRequest};

/// How long one request may take, whole (a call parked in flight answers at
/// once; this bounds a replica that stopped answering).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The replicas and the run's tokens.
pub struct HttpDoor {
    agent: ureq::Agent,
    urls: Vec<String>,
    /// `tenant/subject` → agent token; `operator` → operator token.
    tokens: HashMap<String, String>,
}

/// The tokens a run mints (agents and approvers), revoked when it ends.
pub(super) struct RunTokens {
    pub(super) tokens: HashMap<String, String>,
    pub(super) ids: Vec<String>,
}

impl RunTokens {
    /// One agent token per principal and one operator token per approver.
    pub(super) fn mint(
        control: &mut Engine,
        principals: &[(&str, &str, &str)],
        run_id: &str,
    ) -> Result<Self, EngineError> {
        let name = format!("load-{run_id}");
        let mut tokens = HashMap::new();
        let mut ids = Vec::new();
        for (tenant, subject, approver) in principals {
            let who = TokenFor::Subject { tenant: (*tenant).to_string(), subject: (*subject).to_string() };
            let t = control.create_token(&who, Some(&name), None)?;
            tokens.insert(format!("{tenant}/{subject}"), t.token);
            ids.push(t.row.id);
            if !tokens.contains_key(*approver) {
                // Scoped to the tenants it approves in, as an operator's token should be.
                let mut in_tenants: Vec<String> =
                    principals.iter().filter(|p| p.2 == *approver).map(|p| p.0.to_string()).collect();
                in_tenants.dedup();
                let who = TokenFor::Operator { operator: (*approver).to_string(), tenants: Some(in_tenants) };
                let t = control.create_token(&who, Some(&name), None)?;
                tokens.insert((*approver).to_string(), t.token);
                ids.push(t.row.id);
            }
        }
        Ok(Self { tokens, ids })
    }

    /// Revokes every token of the run.
    pub(super) fn revoke(&self, control: &mut Engine) -> Result<(), EngineError> {
        for id in &self.ids {
            control.revoke_token(id)?;
        }
        Ok(())
    }
}

/// ureq resolves the URL's host before every request, a pooled connection's
/// too, and under a whole-request timeout its resolver does so on a thread it
/// spawns per request (to be able to give up on a hanging lookup): a thread
/// start and two hand-offs per call, measured as a fifth of `bench --http`'s
/// replay latency. An address literal (`http://127.0.0.1:8080`, how a run
/// names its replicas) needs no lookup: it is answered here, on the caller's
/// thread. A host name still goes to ureq's resolver, timeout and all.
#[derive(Debug, Default)]
struct LiteralFirst(DefaultResolver);

impl Resolver for LiteralFirst {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        // `host:port` with an IPv4 or a bracketed IPv6 address; anything else
        // (a name, no port, user info) is not a literal.
        let literal = uri.authority().and_then(|a| a.as_str().parse::<std::net::SocketAddr>().ok());
        match literal {
            Some(addr) => {
                let mut addrs = self.empty();
                addrs.push(addr);
                Ok(addrs)
            }
            None => self.0.resolve(uri, config, timeout),
        }
    }
}

/// ureq writes a request's head and its body in two writes; with
/// `TCP_NODELAY` they leave as two segments, and the server wakes for the
/// head, finds no body yet and waits again: one more wake-up per call (a
/// `bench --http`-style replay measured ~60 µs slower at p50 that way). Most
/// clients (hyper, curl, Python's `http.client`) send a small request in one
/// write; so does this one: each transmit is held until the next one or until
/// the client waits for input, and the two go out in one write.
#[derive(Debug)]
struct OneWrite;

impl Connector<Box<dyn Transport>> for OneWrite {
    type Out = Coalescing;

    fn connect(
        &self,
        _: &ConnectionDetails,
        chained: Option<Box<dyn Transport>>,
    ) -> Result<Option<Coalescing>, ureq::Error> {
        Ok(chained.map(|inner| Coalescing { inner, held: Vec::new() }))
    }
}

/// A transport whose last output waits for the next (see [`OneWrite`]).
#[derive(Debug)]
struct Coalescing {
    inner: Box<dyn Transport>,
    /// Output transmitted by the caller but not yet sent.
    held: Vec<u8>,
}

impl Coalescing {
    /// Sends what is held, then `amount` bytes of the output buffer; in one
    /// write when both fit in the buffer.
    fn send(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return self.inner.transmit_output(amount, timeout);
        }
        let out = self.inner.buffers().output();
        if held.len() + amount <= out.len() {
            out.copy_within(..amount, held.len());
            out[..held.len()].copy_from_slice(&held);
            return self.inner.transmit_output(held.len() + amount, timeout);
        }
        let new = out[..amount].to_vec();
        out[..held.len()].copy_from_slice(&held);
        self.inner.transmit_output(held.len(), timeout)?;
        self.inner.buffers().output()[..amount].copy_from_slice(&new);
        self.inner.transmit_output(amount, timeout)
    }
}

impl Transport for Coalescing {
    fn buffers(&mut self) -> &mut dyn Buffers {
        self.inner.buffers()
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        if self.held.is_empty() && amount <= HOLD_AT_MOST {
            self.held.extend_from_slice(&self.inner.buffers().output()[..amount]);
            return Ok(());
        }
        self.send(amount, timeout)
    }

    fn maybe_await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        if !self.held.is_empty() {
            self.send(0, timeout)?;
        }
        self.inner.maybe_await_input(timeout)
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        if !self.held.is_empty() {
            self.send(0, timeout)?;
        }
        self.inner.await_input(timeout)
    }

    fn is_open(&mut self) -> bool {
        self.inner.is_open()
    }

    fn is_tls(&self) -> bool {
        self.inner.is_tls()
    }
}

/// The largest output [`Coalescing`] holds back (a request head is far smaller).
const HOLD_AT_MOST: usize = 16 * 1024;

fn http_error(what: &str) -> EngineError {
    EngineError::invalid("LOAD_HTTP", format!("the API could not be reached: {what}"))
}

impl HttpDoor {
    pub fn new(urls: &[String], tokens: HashMap<String, String>) -> Self {
        let config =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(REQUEST_TIMEOUT)).build();
        let agent =
            ureq::Agent::with_parts(config, DefaultConnector::default().chain(OneWrite), LiteralFirst::default());
        let urls = urls.iter().map(|u| u.trim_end_matches('/').to_string()).collect();
        Self { agent, urls, tokens }
    }

    fn token(&self, who: &str) -> Result<&str, EngineError> {
        self.tokens.get(who).map(String::as_str).ok_or_else(|| http_error("no token for a principal"))
    }

    /// One POST to the replica `at`, its answer read as an envelope.
    fn post(
        &self,
        at: usize,
        path: &str,
        token: &str,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<Envelope, EngineError> {
        let url = format!("{}{path}", self.urls[at % self.urls.len()]);
        let mut req = self
            .agent
            .post(&url)
            .header("authorization", &format!("Bearer {token}"))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let mut resp = req.send(body).map_err(|e| http_error(&e.to_string()))?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().map_err(|e| http_error(&e.to_string()))?;
        if let Ok(env) = serde_json::from_str::<Envelope>(&text) {
            return Ok(env);
        }
        // A refusal of the server's own: its code, in the envelope's shape.
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let code = v["model_result"]["error"]["code"].as_str().unwrap_or("?").to_string();
        if status == 503 || status == 429 {
            let retry = v["model_result"]["error"]["retry_after_ms"].as_u64().unwrap_or(1000);
            let env = crate::engine::error_envelope(
                Code::ToolUnavailable,
                crate::engine::envelope::ProtectedAudit::default(),
            );
            return Ok(crate::engine::with_retry_after(env, retry));
        }
        Err(EngineError::invalid("LOAD_HTTP_REFUSED", format!("the API refused the call: HTTP {status} {code}")))
    }

    fn identity_headers(call: Option<&CallIdentity>) -> Vec<(&'static str, String)> {
        let Some(c) = call else { return Vec::new() };
        vec![
            ("toolgate-provider", c.provider.clone()),
            ("toolgate-api-family", c.api_family.clone()),
            ("toolgate-response-id", c.response_id.clone()),
            ("toolgate-call-id", c.call_id.clone()),
            ("toolgate-adapter-revision", c.adapter_revision.clone()),
        ]
    }

    /// `POST /v1/tools/{tool}/calls` as the request's subject, with a fault
    /// for this call (demo databases) when the run has a fault rate.
    pub fn dispatch(&self, at: usize, r: &DispatchRequest, fault: Option<String>) -> Result<Envelope, EngineError> {
        let token = self.token(&format!("{}/{}", r.tenant, r.subject))?;
        let mut headers = Self::identity_headers(r.call.as_ref());
        if let Some(k) = &r.idempotency_key {
            headers.push(("idempotency-key", k.clone()));
        }
        if let Some(a) = &r.approval_id {
            headers.push(("toolgate-approval-id", a.clone()));
        }
        if let Some(f) = fault {
            headers.push(("toolgate-fault", f));
        }
        self.post(at, &format!("/v1/tools/{}/calls", r.tool), token, &headers, &r.arguments)
    }

    /// `POST /v1/approvals/{id}/approve` as `approver`.
    pub(super) fn approve(&self, at: usize, approval_id: &str, approver: &str) -> Result<Envelope, EngineError> {
        let token = self.token(approver)?;
        self.post(at, &format!("/v1/approvals/{approval_id}/approve"), token, &[], b"{}")
    }

    /// `POST /v1/status-queries` as the request's subject.
    pub(super) fn query(&self, at: usize, q: &QueryRequest) -> Result<Envelope, EngineError> {
        let token = self.token(&format!("{}/{}", q.tenant, q.subject))?;
        let body = serde_json::json!({
            "status_ref": q.status_ref,
            "expected_request_sha256": q.expected_request_sha256,
        });
        let headers = Self::identity_headers(q.call.as_ref());
        self.post(at, "/v1/status-queries", token, &headers, body.to_string().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use ureq::unversioned::transport::LazyBuffers;

    /// A transport that records each write it is asked to make.
    #[derive(Debug)]
    struct Recorder {
        buffers: LazyBuffers,
        sent: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl Transport for Recorder {
        fn buffers(&mut self) -> &mut dyn Buffers {
            &mut self.buffers
        }

        fn transmit_output(&mut self, amount: usize, _: NextTimeout) -> Result<(), ureq::Error> {
            let bytes = self.buffers.output()[..amount].to_vec();
            self.sent.lock().unwrap().push(bytes);
            Ok(())
        }

        fn await_input(&mut self, _: NextTimeout) -> Result<bool, ureq::Error> {
            Ok(true)
        }

        fn is_open(&mut self) -> bool {
            true
        }
    }

    /// Writes `parts` through a coalescing transport whose buffer holds `size`
    /// bytes, waits for input, and returns the writes that reached the socket.
    fn check(size: usize, parts: &[&[u8]], expect: &[&[u8]]) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let inner = Recorder { buffers: LazyBuffers::new(64, size), sent: sent.clone() };
        let mut t = Coalescing { inner: Box::new(inner), held: Vec::new() };
        for part in parts {
            t.buffers().output()[..part.len()].copy_from_slice(part);
            t.transmit_output(part.len(), NextTimeout::default()).unwrap();
        }
        t.await_input(NextTimeout::default()).unwrap();
        let sent = sent.lock().unwrap().clone();
        assert_eq!(sent, expect.iter().map(|e| e.to_vec()).collect::<Vec<_>>());
    }

    #[test]
    fn a_head_and_its_body_leave_in_one_write() {
        check(1024, &[b"HEAD\r\n\r\n", b"{\"a\":1}"], &[b"HEAD\r\n\r\n{\"a\":1}"]);
        // A request without a body is sent when the client waits for the answer.
        check(1024, &[b"GET\r\n\r\n"], &[b"GET\r\n\r\n"]);
        // Nothing held, nothing written.
        check(1024, &[], &[]);
        // Together they would not fit the buffer: two writes, in order.
        check(12, &[b"HEAD\r\n\r\n", b"0123456789"], &[b"HEAD\r\n\r\n", b"0123456789"]);
        // A third part goes out after the pair (nothing is reordered or lost).
        check(1024, &[b"H", b"B1", b"B2"], &[b"HB1", b"B2"]);
    }

    #[test]
    fn address_literals_resolve_without_a_lookup() {
        let config = ureq::config::Config::default();
        let resolve = |url: &str| {
            let uri: ureq::http::Uri = url.parse().unwrap();
            LiteralFirst::default().resolve(&uri, &config, NextTimeout::default()).map(|a| a.to_vec())
        };
        assert_eq!(resolve("http://127.0.0.1:8080/v1").unwrap(), vec!["127.0.0.1:8080".parse().unwrap()]);
        assert_eq!(resolve("http://[::1]:9/").unwrap(), vec!["[::1]:9".parse().unwrap()]);
        // A name is ureq's to resolve (localhost needs no network).
        assert!(resolve("http://localhost:8080/").unwrap().iter().all(|a| a.ip().is_loopback()));
    }
}
