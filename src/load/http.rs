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
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use crate::engine::canonical::CallIdentity;
use crate::engine::envelope::{Code, Envelope};
use crate::engine::tokens::TokenFor;
use crate::engine::{DispatchRequest, Engine, EngineError, QueryRequest};

/// How long one request may take, whole (a call parked in flight answers at
/// once; this bounds a replica that stopped answering).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The replicas and the run's tokens.
pub(crate) struct HttpDoor {
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
                let t = control.create_token(&TokenFor::Operator((*approver).to_string()), Some(&name), None)?;
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

fn http_error(what: &str) -> EngineError {
    EngineError::invalid("LOAD_HTTP", format!("the API could not be reached: {what}"))
}

impl HttpDoor {
    pub(crate) fn new(urls: &[String], tokens: HashMap<String, String>) -> Self {
        let config =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(REQUEST_TIMEOUT)).build();
        let agent = ureq::Agent::with_parts(config, DefaultConnector::default(), LiteralFirst::default());
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
    pub(crate) fn dispatch(
        &self,
        at: usize,
        r: &DispatchRequest,
        fault: Option<String>,
    ) -> Result<Envelope, EngineError> {
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
