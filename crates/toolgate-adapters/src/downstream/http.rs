//! The `http` adapter: a real HTTP service as a downstream (docs/design.md §7
//! over a real network). The catalog's `downstream.http` section says where to
//! send, which header carries the key, where to look a key up and how to read
//! the reply; the reply is classified by evidence: was the request provably
//! not received (retry), or may it have committed (unknown, ask later)?
//!
//! The client is `ureq` 3: blocking fits the engine's synchronous worker (one
//! engine per thread, one call at a time), it has per-request global,
//! connect, send and receive timeouts and a body-size limit, and its errors
//! say at which stage a call failed (resolve, connect, send, receive), which is
//! the evidence the classification needs. Connections are not pooled: a
//! pooled connection the server had closed would fail after the request was
//! written and look like a possibly-received call.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::http_map;
use crate::engine::canonical::{canonical_string, parse_strict};
use crate::engine::contracts::{Contract, DownstreamRef, Effect};
use crate::engine::faults::Fault;
use crate::engine::tool::{
    Downstream, DownstreamContext, DownstreamError, DownstreamFactory, DownstreamRequest, Lookup, Receipt, Refusal,
    Reply,
};

/// The header that carries the request digest, so that a provider that
/// records it can prove which request a receipt is for.
pub const REQUEST_DIGEST_HEADER: &str = "Toolgate-Request-Sha256";
/// The header that carries the business intent label (a hash of the scope),
/// so a provider can count effects per intent.
pub const INTENT_HEADER: &str = "Toolgate-Intent";
/// The test header a simulated provider server obeys (a fault spec).
pub const FAULT_HEADER: &str = "Toolgate-Fault";
/// The longest reply body read by default.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 256 * 1024;
/// The shortest attempt worth starting: below it nothing is sent.
const MIN_ATTEMPT_MS: u64 = 100;
/// How much earlier than the whole-call deadline the connect deadline falls.
const CONNECT_MARGIN_MS: u64 = 50;
/// The largest Retry-After honoured: one hour.
const MAX_RETRY_AFTER_MS: u64 = 3_600_000;

/// One endpoint: a method, a URL template and how the request is shaped.
/// Templates hold `{key}` (the downstream key) and, in execute's,
/// `{args.NAME}` (an argument of the call; see [`super::http_map`]).
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// `POST`, `PUT` or `PATCH` for a tool with an effect, `GET` for a read
    /// tool's execute and for lookup.
    pub method: String,
    /// Path after the base URL, e.g. `/v1/refunds`,
    /// `/channels/{args.channel}/messages` or `/v1/refunds/by-key/{key}`;
    /// each placeholder's value is percent-encoded as one path segment.
    pub path: String,
    /// Query parameters: name → template. One whose argument is absent is left out.
    #[serde(default)]
    pub query: std::collections::BTreeMap<String, String>,
    /// Fixed headers: name → template (secrets go in `secret_headers`).
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body as a JSON template (execute only). Absent: the call's
    /// arguments as they are.
    #[serde(default)]
    pub body: Option<Value>,
    /// Send the body form-encoded (`application/x-www-form-urlencoded`, a
    /// flat object of scalars) instead of as JSON (execute only).
    #[serde(default)]
    pub form: bool,
    /// The statuses that mean "committed" (execute only). Empty: any 2xx.
    #[serde(default)]
    pub success: Vec<u16>,
    /// The statuses that mean "this key is in use with another request"
    /// (execute only; `STATUS_CONFLICT`). Empty: 422.
    #[serde(default)]
    pub key_conflict: Vec<u16>,
}

/// Where each part of a reply is, as JSON pointers into its body.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyPointers {
    /// The receipt id (required in a 2xx reply of a tool with an effect; a
    /// read tool has none).
    #[serde(default)]
    pub receipt_id: Option<String>,
    /// The provider's request id (optional).
    #[serde(default)]
    pub request_id: Option<String>,
    /// The result the tool's output contract checks (`""`: the whole body).
    #[serde(default)]
    pub result: String,
    /// The request digest the provider recorded (optional; see [`REQUEST_DIGEST_HEADER`]).
    #[serde(default)]
    pub body_sha256: Option<String>,
    /// The idempotency key the provider echoes with its receipt (optional).
    #[serde(default)]
    pub key: Option<String>,
}

/// A header whose value is a secret, read from the environment or a file
/// when an engine opens the downstream; never stored in the catalog, the
/// ledger, traces or logs.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretHeader {
    /// Header name.
    pub header: String,
    /// Environment variable holding the value.
    #[serde(default)]
    pub env: Option<String>,
    /// File holding the value (trailing line break dropped).
    #[serde(default)]
    pub file: Option<String>,
    /// Put before the value (e.g. `Bearer `).
    #[serde(default)]
    pub prefix: String,
}

/// The `downstream.http` section of a catalog entry.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// The base URL (`http://127.0.0.1:8081`), or
    #[serde(default)]
    pub base_url: Option<String>,
    /// the environment variable that holds it.
    #[serde(default)]
    pub base_url_env: Option<String>,
    /// Execute endpoint.
    pub execute: Endpoint,
    /// Lookup-by-key endpoint; `null` when the service has none (the field
    /// must be there either way: a missing lookup is a mistake, no lookup is
    /// a fact about the service).
    pub lookup: Option<Endpoint>,
    /// The header that carries the downstream key (IETF httpapi
    /// Idempotency-Key draft, Stripe); empty for a downstream that takes none.
    #[serde(default = "default_key_header")]
    pub key_header: String,
    /// Where the reply's parts are.
    pub reply: ReplyPointers,
    /// Connect timeout (the attempt timeout of the tool bounds the whole call).
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Largest reply body read.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: u64,
    /// The provider documents that its 5xx replies mean "not committed":
    /// then a 5xx is retried like a 503. Off by default: a 5xx after the
    /// request was sent may have committed.
    #[serde(default)]
    pub server_error_means_not_committed: bool,
    /// Headers with secret values.
    #[serde(default)]
    pub secret_headers: Vec<SecretHeader>,
    /// TLS for an `https` base URL beyond the defaults (Mozilla's roots).
    #[serde(default)]
    pub tls: Option<TlsSettings>,
}

/// `downstream.http.tls`: a private CA and a client certificate (mTLS),
/// read from files when an engine opens the downstream.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file of CA certificates trusted beside the platform's own roots.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// PEM file of the client certificate chain (mTLS), with `client_key_file`.
    #[serde(default)]
    pub client_cert_file: Option<String>,
    /// PEM file of the client certificate's private key, with `client_cert_file`.
    #[serde(default)]
    pub client_key_file: Option<String>,
}

fn default_key_header() -> String {
    "Idempotency-Key".into()
}
fn default_connect_timeout() -> u64 {
    1_000
}
fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY_BYTES
}

/// The JSON Schema of the `downstream.http` section, derived from
/// [`HttpConfig`] (docs/catalog.md documents every field of it).
pub fn http_section_schema() -> Value {
    serde_json::to_value(schemars::schema_for!(HttpConfig)).unwrap_or(Value::Null)
}

fn http_validator() -> Option<&'static jsonschema::Validator> {
    static V: std::sync::OnceLock<Option<jsonschema::Validator>> = std::sync::OnceLock::new();
    // Derived from this crate's own types, it compiles; were it ever not to,
    // the typed read below still refuses (one problem at a time), no panic.
    V.get_or_init(|| jsonschema::validator_for(&http_section_schema()).ok()).as_ref()
}

impl HttpConfig {
    /// Parses and checks a section; `Err((field, why))` names the first
    /// problem's field ([`HttpConfig::parse_all`]: every problem).
    pub fn parse(d: &DownstreamRef) -> Result<HttpConfig, (String, String)> {
        Self::parse_all(d).map_err(|mut all| all.remove(0))
    }

    /// Parses and checks a section, every problem at once: its shape (each
    /// missing, unknown or mistyped field), then its rules. Never empty on `Err`.
    pub fn parse_all(d: &DownstreamRef) -> Result<HttpConfig, Vec<(String, String)>> {
        let Some(v) = &d.http else {
            return Err(vec![("http".into(), "the http adapter needs an `http` section".into())]);
        };
        let mut shape = http_validator()
            .map(|val| crate::engine::contracts::shape_problems(val, &http_section_schema(), v, "http"))
            .unwrap_or_default();
        if v.is_object() && v.get("lookup").is_none() {
            shape.push((
                "http.lookup".into(),
                "say how a call is looked up by its key ({\"method\": \"GET\", \"path\": \"/.../{key}\"}), or \"lookup\": null when the service has no lookup".into(),
            ));
        }
        if !shape.is_empty() {
            return Err(shape);
        }
        Self::rules(v).map_err(|one| vec![one])
    }

    /// The rules of a section whose shape fits, the first broken one.
    fn rules(v: &Value) -> Result<HttpConfig, (String, String)> {
        let c: HttpConfig = serde_path_to_error::deserialize(v.clone())
            .map_err(|e| (format!("http.{}", e.path()), e.into_inner().to_string()))?;
        match (&c.base_url, &c.base_url_env) {
            (Some(u), None) => {
                if !(u.starts_with("http://") || u.starts_with("https://")) {
                    return Err(("http.base_url".into(), "must start with http:// or https://".into()));
                }
            }
            (None, Some(e)) if !e.is_empty() => {}
            _ => return Err(("http.base_url".into(), "give exactly one of base_url and base_url_env".into())),
        }
        if !matches!(c.execute.method.as_str(), "GET" | "POST" | "PUT" | "PATCH") {
            return Err(("http.execute.method".into(), "GET (a read tool), or POST, PUT or PATCH".into()));
        }
        if !c.execute.path.starts_with('/') {
            return Err(("http.execute.path".into(), "starts with /".into()));
        }
        if let Some(lookup) = &c.lookup {
            if lookup.method != "GET" {
                return Err(("http.lookup.method".into(), "GET".into()));
            }
            if !lookup.path.starts_with('/') {
                return Err(("http.lookup.path".into(), "starts with /".into()));
            }
            let mut templates =
                std::iter::once(&lookup.path).chain(lookup.query.values()).chain(lookup.headers.values());
            if !templates.any(|t| t.contains("{key}")) {
                return Err((
                    "http.lookup.path".into(),
                    "looks a call up by its key: put {key} in its path (or a query parameter or header)".into(),
                ));
            }
            // A lookup knows the key and nothing else of the call.
            let named = std::iter::once(("http.lookup.path".to_string(), &lookup.path))
                .chain(lookup.query.iter().map(|(k, v)| (format!("http.lookup.query.{k}"), v)))
                .chain(lookup.headers.iter().map(|(k, v)| (format!("http.lookup.headers.{k}"), v)));
            for (field, t) in named {
                let found = http_map::placeholders(t).map_err(|why| (field.clone(), why))?;
                if found.iter().any(|p| *p != http_map::Placeholder::Key) {
                    return Err((field, format!("{t:?}: a lookup is asked by {{key}} alone")));
                }
            }
            if lookup.body.is_some() || lookup.form || !lookup.success.is_empty() || !lookup.key_conflict.is_empty() {
                return Err((
                    "http.lookup".into(),
                    "a lookup is a GET: body, form, success and key_conflict are execute's".into(),
                ));
            }
        }
        // Every template parses: a placeholder that is not filled in would be
        // sent literally (a path the service never serves, or worse, one it does).
        let e = &c.execute;
        for (field, t) in std::iter::once(("http.execute.path".to_string(), &e.path))
            .chain(e.query.iter().map(|(k, v)| (format!("http.execute.query.{k}"), v)))
            .chain(e.headers.iter().map(|(k, v)| (format!("http.execute.headers.{k}"), v)))
        {
            http_map::placeholders(t).map_err(|why| (field, why))?;
        }
        if let Some(b) = &e.body {
            http_map::json_placeholders(b).map_err(|why| ("http.execute.body".to_string(), why))?;
            if e.form && !b.as_object().is_some_and(|o| o.values().all(|v| !v.is_object() && !v.is_array())) {
                return Err((
                    "http.execute.form".into(),
                    "a form body is a flat object of strings, numbers and booleans".into(),
                ));
            }
        } else if e.form {
            return Err(("http.execute.form".into(), "a form body needs a body template (the fields)".into()));
        }
        for (field, names) in [
            ("http.execute.headers", e.headers.keys().collect::<Vec<_>>()),
            ("http.lookup.headers", c.lookup.iter().flat_map(|l| l.headers.keys()).collect()),
        ] {
            if let Some(bad) =
                names.iter().find(|h| h.is_empty() || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
            {
                return Err((field.into(), format!("{bad:?} is not a header name (letters, digits, -)")));
            }
        }
        if e.success.iter().any(|s| !(200..=299).contains(s)) {
            return Err(("http.execute.success".into(), "2xx statuses (any other status is not a commit)".into()));
        }
        if e.key_conflict.iter().any(|s| !(400..=499).contains(s) || matches!(s, 401 | 403 | 409 | 429)) {
            return Err((
                "http.execute.key_conflict".into(),
                "4xx statuses other than 401, 403, 409 and 429 (those say something else)".into(),
            ));
        }
        let pointers = [
            c.reply.receipt_id.as_ref(),
            c.reply.request_id.as_ref(),
            Some(&c.reply.result),
            c.reply.body_sha256.as_ref(),
            c.reply.key.as_ref(),
        ];
        // The receipt and request ids may also come from a response header.
        let from_header = |p: &&String| p.strip_prefix("header:").is_some_and(|h| !h.is_empty());
        if pointers.iter().flatten().any(|p| !p.is_empty() && !p.starts_with('/') && !from_header(p)) {
            return Err((
                "http.reply".into(),
                "JSON pointers start with / (\"\" is the whole body); receipt_id and request_id may be header:NAME"
                    .into(),
            ));
        }
        if [&c.reply.result]
            .into_iter()
            .chain(c.reply.body_sha256.as_ref())
            .chain(c.reply.key.as_ref())
            .any(|p| p.starts_with("header:"))
        {
            return Err(("http.reply".into(), "only receipt_id and request_id may come from a header".into()));
        }
        if c.connect_timeout_ms == 0 || c.max_body_bytes == 0 || c.max_body_bytes > 16 * 1024 * 1024 {
            return Err(("http".into(), "connect_timeout_ms > 0 and 0 < max_body_bytes <= 16 MiB".into()));
        }
        if let Some(t) = &c.tls {
            if t.client_cert_file.is_some() != t.client_key_file.is_some() {
                return Err(("http.tls".into(), "give client_cert_file and client_key_file together".into()));
            }
            if t.ca_file.is_none() && t.client_cert_file.is_none() {
                return Err(("http.tls".into(), "give ca_file, or client_cert_file with client_key_file".into()));
            }
            if c.base_url.as_deref().is_some_and(|u| u.starts_with("http://")) {
                return Err(("http.tls".into(), "the base URL is plain http://: TLS settings would be ignored".into()));
            }
        }
        for (i, s) in c.secret_headers.iter().enumerate() {
            if s.env.is_some() == s.file.is_some() {
                return Err((format!("http.secret_headers[{i}]"), "give exactly one of env and file".into()));
            }
            if s.header.is_empty() || !s.header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                return Err((format!("http.secret_headers[{i}].header"), "a header name (letters, digits, -)".into()));
            }
        }
        Ok(c)
    }
}

/// The `http` adapter factory.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpAdapter;

impl HttpAdapter {
    /// The rules that bind a parsed section to the rest of the contract.
    fn check_parsed(contract: &Contract, c: &HttpConfig) -> Result<(), (String, String)> {
        let d = &contract.downstream;
        if d.mcp.is_some() {
            return Err(("mcp".into(), "only the mcp adapter takes mcp settings".into()));
        }
        // A read tool is a GET with no key, nothing to look up; a tool with
        // an effect is never a GET (a GET must not act) and has a receipt.
        if contract.effect == Effect::Read {
            if c.execute.method != "GET" {
                return Err(("http.execute.method".into(), "a read tool is a GET".into()));
            }
            if c.execute.body.is_some() || c.execute.form {
                return Err(("http.execute.body".into(), "a GET sends no body".into()));
            }
            if c.lookup.is_some() {
                return Err(("http.lookup".into(), "a read tool records nothing to look up: \"lookup\": null".into()));
            }
        } else {
            if c.execute.method == "GET" {
                return Err((
                    "http.execute.method".into(),
                    "a tool with an effect is POST, PUT or PATCH (a GET must not act)".into(),
                ));
            }
            if c.reply.receipt_id.is_none() {
                return Err(("http.reply.receipt_id".into(), "a tool with an effect needs its receipt id".into()));
            }
        }
        // Every {args.NAME} names an input property; one in the path, a
        // required one (a path with a hole in it is not the endpoint).
        let props = contract.input_schema.get("properties");
        let required: Vec<&str> = contract
            .input_schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let e = &c.execute;
        let mut uses: Vec<(String, bool, Vec<http_map::Placeholder>)> = Vec::new();
        let parsed = |t: &str| http_map::placeholders(t).unwrap_or_default();
        uses.push(("http.execute.path".into(), true, parsed(&e.path)));
        uses.extend(e.query.iter().map(|(k, v)| (format!("http.execute.query.{k}"), false, parsed(v))));
        uses.extend(e.headers.iter().map(|(k, v)| (format!("http.execute.headers.{k}"), false, parsed(v))));
        if let Some(b) = &e.body {
            uses.push(("http.execute.body".into(), false, http_map::json_placeholders(b).unwrap_or_default()));
        }
        for (field, in_path, found) in uses {
            for p in found {
                let http_map::Placeholder::Arg(path) = p else { continue };
                let name = path[0].as_str();
                if props.and_then(|p| p.get(name)).is_none() {
                    return Err((field, format!("{{args.{}}}: {name:?} is not an input property", path.join("."))));
                }
                if in_path && !required.contains(&name) {
                    return Err((
                        field,
                        format!("{{args.{name}}} is in the path, so the input schema must require {name:?}"),
                    ));
                }
            }
        }
        if d.dedupes_keys && c.key_header.is_empty() {
            // It cannot de-duplicate a key it is never sent.
            return Err(("dedupes_keys".into(), "claims key de-duplication but http.key_header is empty".into()));
        }
        if d.lookup.is_some() && c.lookup.is_some() {
            // Two ways to ask, one of which acts: the reading one would be
            // used for evidence and the acting one for queries, silently.
            return Err((
                "http.lookup".into(),
                "downstream.lookup re-sends to ask, so the service has no lookup by key here: \"lookup\": null (or drop downstream.lookup)".into(),
            ));
        }
        if c.lookup.is_some() && c.key_header.is_empty() {
            // The service is never told the key: a lookup by it cannot match.
            return Err((
                "http.lookup".into(),
                "the key is never sent (key_header is empty), so a lookup by {key} can never match: set key_header, or \"lookup\": null".into(),
            ));
        }
        // A lookup's answer is evidence only when something in it binds it to
        // this request; a receipt that merely came back from the lookup URL
        // may be another request's.
        if c.lookup.is_some()
            && c.reply.body_sha256.is_none()
            && c.reply.key.is_none()
            && contract.result_echoes.is_empty()
        {
            return Err((
                "http.reply".into(),
                "nothing binds a lookup's receipt to the request: map body_sha256 (the request digest the \
                 provider records) or key (the idempotency key it echoes), or list the tool's result_echoes"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl DownstreamFactory for HttpAdapter {
    fn check(&self, contract: &Contract) -> Result<(), (String, String)> {
        match self.check_all(contract).into_iter().next() {
            Some(first) => Err(first),
            None => Ok(()),
        }
    }

    fn check_all(&self, contract: &Contract) -> Vec<(String, String)> {
        match HttpConfig::parse_all(&contract.downstream) {
            Err(all) => all,
            Ok(c) => Self::check_parsed(contract, &c).err().into_iter().collect(),
        }
    }

    fn open(&self, d: &DownstreamRef, ctx: &DownstreamContext<'_>) -> Result<Box<dyn Downstream>, DownstreamError> {
        let setup = |reason: String| DownstreamError::Setup { name: d.name.clone(), reason };
        let cfg = HttpConfig::parse(d).map_err(|(f, why)| setup(format!("{f}: {why}")))?;
        let base = match (&cfg.base_url, &cfg.base_url_env) {
            (Some(u), _) => u.clone(),
            (None, Some(var)) => {
                std::env::var(var).map_err(|_| setup(format!("environment variable {var} is not set")))?
            }
            (None, None) => return Err(setup("no base URL".into())),
        };
        let base = base.trim_end_matches('/').to_string();
        let mut secrets = Vec::new();
        for s in &cfg.secret_headers {
            let value = match (&s.env, &s.file) {
                (Some(var), _) => {
                    std::env::var(var).map_err(|_| setup(format!("secret header {}: {var} is not set", s.header)))?
                }
                (None, Some(file)) => std::fs::read_to_string(file)
                    .map_err(|e| setup(format!("secret header {}: its file cannot be read ({})", s.header, e.kind())))?
                    .trim_end_matches(['\n', '\r'])
                    .to_string(),
                (None, None) => return Err(setup("a secret header without a source".into())),
            };
            secrets.push((s.header.clone(), format!("{}{value}", s.prefix)));
        }
        let mut config = ureq::Agent::config_builder();
        if let Some(t) = &cfg.tls {
            config = config.tls_config(tls_config(t).map_err(setup)?);
        }
        let agent: ureq::Agent = config
            .http_status_as_error(false)
            .max_redirects(0)
            .max_idle_connections(0)
            .user_agent("toolgate")
            .build()
            .into();
        Ok(Box::new(HttpDownstream { name: d.name.clone(), cfg, base, secrets, agent, faults: ctx.faults.clone() }))
    }
}

/// A request as the mapping shaped it.
struct Mapped {
    url: String,
    query: Vec<(String, String)>,
    headers: Vec<(String, String)>,
    body: MappedBody,
}

enum MappedBody {
    Json(String),
    Form(Vec<(String, String)>),
}

/// One HTTP downstream as an engine holds it.
pub struct HttpDownstream {
    name: String,
    cfg: HttpConfig,
    base: String,
    /// (header, value): only in memory, never formatted.
    secrets: Vec<(String, String)>,
    agent: ureq::Agent,
    /// The engine's fault plan: a fault set there (tests, `--fault`, the lab)
    /// travels as a `Toolgate-Fault` header, which the simulated provider
    /// server obeys; with no plan set nothing is added.
    faults: std::sync::Arc<std::sync::Mutex<crate::engine::faults::FaultPlan>>,
}

impl std::fmt::Debug for HttpDownstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpDownstream").field("name", &self.name).field("base", &self.base).finish_non_exhaustive()
    }
}

/// The TLS configuration of `downstream.http.tls`: the platform's roots plus
/// the CA file's, and the client certificate. Errors name the field and the
/// kind of failure, never the path.
fn tls_config(t: &TlsSettings) -> Result<ureq::tls::TlsConfig, String> {
    use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};
    let pem = |field: &str, path: &str| -> Result<Vec<PemItem<'static>>, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("http.tls.{field} cannot be read ({})", e.kind()))?;
        ureq::tls::parse_pem(&bytes).collect::<Result<Vec<_>, _>>().map_err(|_| format!("http.tls.{field} is not PEM"))
    };
    let certs = |field: &str, items: Vec<PemItem<'static>>| -> Result<Vec<Certificate<'static>>, String> {
        let out: Vec<Certificate<'static>> = items
            .into_iter()
            .filter_map(|i| match i {
                PemItem::Certificate(c) => Some(c),
                _ => None,
            })
            .collect();
        if out.is_empty() {
            return Err(format!("http.tls.{field} holds no certificate"));
        }
        Ok(out)
    };
    let mut b = TlsConfig::builder();
    if let Some(ca) = &t.ca_file {
        let mut roots = certs("ca_file", pem("ca_file", ca)?)?;
        // The platform's trust store too: a private CA is added, not the only one.
        let native = rustls_native_certs::load_native_certs();
        if !native.errors.is_empty() {
            tracing::warn!(errors = native.errors.len(), "some of the platform's root certificates could not be read");
        }
        roots.extend(native.certs.into_iter().map(|c| Certificate::from_der(c.as_ref()).to_owned()));
        b = b.root_certs(RootCerts::new_with_certs(&roots));
    }
    if let (Some(cf), Some(kf)) = (&t.client_cert_file, &t.client_key_file) {
        let chain = certs("client_cert_file", pem("client_cert_file", cf)?)?;
        let key: PrivateKey<'static> = pem("client_key_file", kf)?
            .into_iter()
            .find_map(|i| match i {
                PemItem::PrivateKey(k) => Some(k),
                _ => None,
            })
            .ok_or_else(|| "http.tls.client_key_file holds no private key".to_string())?;
        b = b.client_cert(Some(ClientCert::new_with_certs(&chain, key)));
    }
    Ok(b.build())
}

/// Percent-encodes a key for a URL path segment (RFC 3986 unreserved kept).
fn encode_segment(s: &str) -> String {
    const SEGMENT: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
    percent_encoding::utf8_percent_encode(s, SEGMENT).to_string()
}

/// Retry-After as delta-seconds or an HTTP date (RFC 9110 §10.2.3), in ms, bounded.
pub fn retry_after_ms(value: Option<&str>, now: std::time::SystemTime) -> Option<u64> {
    let v = value?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(secs.saturating_mul(1000).min(MAX_RETRY_AFTER_MS));
    }
    let at = http_date(v)?;
    let now = chrono::DateTime::<chrono::Utc>::from(now);
    let ms = (at - now).num_milliseconds().max(0) as u64;
    Some(ms.min(MAX_RETRY_AFTER_MS))
}

/// An HTTP date: IMF-fixdate, or one of the two obsolete forms a recipient
/// must still accept (RFC 9110 §5.6.7): RFC 850 (`Sunday, 06-Nov-94 08:49:37
/// GMT`, a two-digit year read as 1969-2068) and asctime (`Sun Nov  6 08:49:37 1994`).
fn http_date(v: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc2822(v) {
        return Some(at.with_timezone(&chrono::Utc));
    }
    ["%A, %d-%b-%y %H:%M:%S GMT", "%a %b %e %H:%M:%S %Y"]
        .iter()
        .find_map(|f| chrono::NaiveDateTime::parse_from_str(v, f).ok())
        .map(|n| n.and_utc())
}

/// Whether a failed call provably never reached the server (nothing was sent).
fn not_received(e: &ureq::Error) -> Option<Reply> {
    match e {
        ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => Some(Reply::ConnectTimeout),
        ureq::Error::HostNotFound | ureq::Error::ConnectionFailed | ureq::Error::BadUri(_) => {
            Some(Reply::Unavailable { retry_after_ms: None })
        }
        ureq::Error::Io(io)
            if matches!(io.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable) =>
        {
            Some(Reply::Unavailable { retry_after_ms: None })
        }
        // A write refused because the peer had already closed: part of the
        // request never left, so the server never had all of it (an error
        // reading the reply after a complete write is a reset, not this).
        // Also how a server that refuses the client certificate shows under
        // TLS 1.3, where the client writes before it hears the refusal.
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe => {
            Some(Reply::Unavailable { retry_after_ms: None })
        }
        // TLS set-up refused before the handshake completed (a certificate
        // that does not verify, no common protocol): TLS sends no application
        // data before the handshake ends (ureq uses no early data), so the
        // request was never written. Retried with the same key like a refused
        // connection; the breaker counts it and the log says why.
        ureq::Error::Tls(_) | ureq::Error::TlsRequired | ureq::Error::Pem(_) => {
            Some(Reply::Unavailable { retry_after_ms: None })
        }
        ureq::Error::Rustls(e) if handshake_refusal(e) => Some(Reply::Unavailable { retry_after_ms: None }),
        ureq::Error::Io(io)
            if io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).is_some_and(handshake_refusal) =>
        {
            Some(Reply::Unavailable { retry_after_ms: None })
        }
        _ => None,
    }
}

/// The rustls errors that can only happen during the handshake, before any
/// request byte is sent. Errors that can also arise later on the connection
/// (a bad record, a closed connection) are not here: those stay ambiguous.
fn handshake_refusal(e: &rustls::Error) -> bool {
    use rustls::{AlertDescription as A, Error as E};
    match e {
        E::InvalidCertificate(_)
        | E::NoCertificatesPresented
        | E::UnsupportedNameType
        | E::PeerIncompatible(_)
        | E::InappropriateHandshakeMessage { .. }
        | E::InvalidCertRevocationList(_)
        | E::NoApplicationProtocol => true,
        E::AlertReceived(a) => matches!(
            a,
            A::HandshakeFailure
                | A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::ProtocolVersion
                | A::InsufficientSecurity
                | A::IllegalParameter
                | A::CertificateRequired
                | A::NoApplicationProtocol
                | A::UnrecognisedName
        ),
        _ => false,
    }
}

fn pointer<'a>(body: &'a Value, p: &str) -> Option<&'a Value> {
    if p.is_empty() {
        Some(body)
    } else {
        body.pointer(p)
    }
}

impl HttpDownstream {
    /// A request with its timeouts (whole call, connect), the mapped query
    /// and headers, the key (none for a read), the digest and intent, the
    /// secrets and a test fault.
    fn dressed<B>(
        &self,
        b: ureq::RequestBuilder<B>,
        (total, connect): (Duration, Duration),
        key: &str,
        req: &DownstreamRequest,
        m: &Mapped,
    ) -> ureq::RequestBuilder<B> {
        let mut b = b
            .config()
            .timeout_global(Some(total))
            .timeout_connect(Some(connect))
            .build()
            .header(REQUEST_DIGEST_HEADER, &req.request_sha256);
        if !req.intent.is_empty() {
            b = b.header(INTENT_HEADER, &req.intent);
        }
        for (k, v) in &m.query {
            b = b.query(k, v);
        }
        for (h, v) in &m.headers {
            b = b.header(h, v);
        }
        if !self.cfg.key_header.is_empty() && !key.is_empty() {
            b = b.header(&self.cfg.key_header, key);
        }
        for (h, v) in &self.secrets {
            b = b.header(h, v);
        }
        let fault = self.faults.lock().map_or(Fault::Ok, |mut f| f.next_fault());
        if fault != Fault::Ok {
            b = b.header(FAULT_HEADER, &fault.spec());
        }
        b
    }

    /// What execute sends, shaped by the catalog's mapping.
    fn mapped(&self, key: &str, args: &Value) -> Result<Mapped, String> {
        let e = &self.cfg.execute;
        let path = http_map::fill_text(&e.path, key, args, &encode_segment)?
            .ok_or_else(|| "the path names an argument the call does not have".to_string())?;
        let plain = |t: &String| http_map::fill_text(t, key, args, &|x| x.to_string());
        let mut query = Vec::new();
        for (k, t) in &e.query {
            if let Some(v) = plain(t)? {
                query.push((k.clone(), v));
            }
        }
        let mut headers = Vec::new();
        for (k, t) in &e.headers {
            if let Some(v) = plain(t)? {
                headers.push((k.clone(), v));
            }
        }
        let body = match &e.body {
            None => MappedBody::Json(canonical_string(args)),
            Some(t) => {
                let filled = http_map::fill_json(t, key, args)?;
                if e.form {
                    MappedBody::Form(http_map::form_fields(&filled)?)
                } else {
                    MappedBody::Json(canonical_string(&filled))
                }
            }
        };
        Ok(Mapped { url: format!("{}{path}", self.base), query, headers, body })
    }

    /// A 2xx body as a receipt (`None`: it does not say what the contract needs).
    fn receipt(&self, body: &[u8], headers: Vec<(String, String)>) -> Option<Receipt> {
        let v = parse_strict(body, body.len(), 64).ok()?;
        let p = &self.cfg.reply;
        // `header:NAME`: from a response header instead of the body.
        let text = |ptr: &str| -> Option<String> {
            match ptr.strip_prefix("header:") {
                Some(h) => headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(h)).map(|(_, v)| v.clone()),
                None => pointer(&v, ptr)?.as_str().map(str::to_string),
            }
        };
        // A read tool's answer has no receipt.
        let receipt_id = match &p.receipt_id {
            Some(rp) => text(rp)?,
            None => String::new(),
        };
        if (p.receipt_id.is_some() && receipt_id.is_empty()) || receipt_id.len() > 256 {
            return None;
        }
        let request_id = match &p.request_id {
            Some(rp) => text(rp)?,
            None => String::new(),
        };
        let body_sha256 = match &p.body_sha256 {
            Some(bp) => Some(pointer(&v, bp)?.as_str()?.to_string()),
            None => None,
        };
        let key = match &p.key {
            Some(kp) => Some(pointer(&v, kp)?.as_str()?.to_string()),
            None => None,
        };
        let result = pointer(&v, &p.result)?.clone();
        Some(Receipt { receipt_id, request_id, body_sha256, key, result, headers })
    }

    fn read_body(&self, resp: &mut ureq::http::Response<ureq::Body>) -> Result<Vec<u8>, ureq::Error> {
        resp.body_mut().with_config().limit(self.cfg.max_body_bytes).read_to_vec()
    }

    /// A refusal's status, body digest and redacted excerpt. A body that
    /// cannot be read whole (too large, cut off) is described by what was
    /// read: the refusal itself is certain from the status.
    fn refusal(&self, status: u16, resp: &mut ureq::http::Response<ureq::Body>) -> Refusal {
        let body = self.read_body(resp).unwrap_or_default();
        let secrets: Vec<&str> = self.secrets.iter().map(|(_, v)| v.as_str()).collect();
        Refusal::of_body(status, &body, &secrets)
    }
}

fn header(resp: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

impl Downstream for HttpDownstream {
    fn execute(&mut self, key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError> {
        // ureq reports a timeout by the earliest deadline it ran into, so the
        // connect deadline must come strictly before the whole-call deadline
        // for a connect that runs out of time to say "connect" (provably not
        // received) rather than "global" (ambiguous: treated as unknown).
        if req.timeout_ms < MIN_ATTEMPT_MS {
            // Too little time left to even connect: nothing is sent.
            return Ok(Reply::ConnectTimeout);
        }
        let total = Duration::from_millis(req.timeout_ms);
        let connect = Duration::from_millis(self.cfg.connect_timeout_ms.min(req.timeout_ms - CONNECT_MARGIN_MS));
        let m = match self.mapped(key, &req.arguments) {
            Ok(m) => m,
            // Nothing was sent: the arguments do not fill the catalog's mapping.
            Err(why) => return Ok(Reply::Rejected { reason: format!("request mapping: {why}"), refusal: None }),
        };
        let times = (total, connect);
        let sent = match (self.cfg.execute.method.as_str(), &m.body) {
            // A read tool's GET (the catalog allows it for reads alone).
            ("GET", _) => self.dressed(self.agent.get(&m.url), times, key, req, &m).call(),
            (method, body) => {
                let b = match method {
                    "PUT" => self.agent.put(&m.url),
                    "PATCH" => self.agent.patch(&m.url),
                    _ => self.agent.post(&m.url),
                };
                let b = self.dressed(b, times, key, req, &m);
                match body {
                    MappedBody::Json(text) => b.header("Content-Type", "application/json").send(text.as_bytes()),
                    // Sent as bytes with its length (ureq's `send_form` streams it).
                    MappedBody::Form(fields) => b
                        .header("Content-Type", "application/x-www-form-urlencoded")
                        .send(http_map::form_encode(fields).as_bytes()),
                }
            }
        };
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => {
                let reply = not_received(&e).unwrap_or(Reply::TimedOut);
                tracing::info!(downstream = %self.name, error = %e, "http execute failed");
                return Ok(reply);
            }
        };
        let status = resp.status().as_u16();
        let retry_after = retry_after_ms(header(&resp, "retry-after").as_deref(), std::time::SystemTime::now());
        let e = &self.cfg.execute;
        let key_conflict = if e.key_conflict.is_empty() { status == 422 } else { e.key_conflict.contains(&status) };
        Ok(match status {
            _ if key_conflict => Reply::KeyConflict,
            // A 2xx the catalog does not list as a commit: it may have committed.
            200..=299 if !e.success.is_empty() && !e.success.contains(&status) => Reply::ServerError,
            200..=299 => {
                let headers: Vec<(String, String)> = resp
                    .headers()
                    .iter()
                    .filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_string(), v.to_string())))
                    .collect();
                match self.read_body(&mut resp) {
                    // Committed, but the receipt did not arrive whole.
                    Err(ureq::Error::BodyExceedsLimit(_)) => Reply::Malformed,
                    Err(_) => Reply::TimedOut,
                    Ok(b) => self.receipt(&b, headers).map_or(Reply::Malformed, Reply::Committed),
                }
            }
            409 => Reply::InProgress { retry_after_ms: retry_after },
            429 => Reply::RateLimited { retry_after_ms: retry_after.unwrap_or(0) },
            503 => Reply::Unavailable { retry_after_ms: retry_after },
            500..=599 if self.cfg.server_error_means_not_committed => {
                Reply::Unavailable { retry_after_ms: retry_after }
            }
            401 | 403 => {
                let refusal = self.refusal(status, &mut resp);
                // Loud: the operator's configuration is wrong (a rotated or
                // missing secret); every call to this downstream will meet it.
                tracing::error!(
                    downstream = %self.name,
                    status,
                    body_sha256 = %refusal.body_sha256,
                    "downstream refused toolgate's credentials: check its secret_headers"
                );
                Reply::AuthRefused(refusal)
            }
            400..=499 => {
                let refusal = self.refusal(status, &mut resp);
                Reply::Rejected { reason: format!("http {status}"), refusal: Some(refusal) }
            }
            // 5xx after the request was sent, or a status this adapter does not
            // expect (a redirect): it may have committed.
            _ => Reply::ServerError,
        })
    }

    fn lookup(&mut self, key: &str, timeout_ms: u64) -> Result<Lookup, DownstreamError> {
        if timeout_ms < MIN_ATTEMPT_MS {
            return Ok(Lookup::Unavailable);
        }
        let Some(lookup) = &self.cfg.lookup else { return Ok(Lookup::Unsupported) };
        // A lookup's templates hold {key} alone (the catalog's check).
        let fill = |t: &String, enc: &dyn Fn(&str) -> String| {
            http_map::fill_text(t, key, &Value::Null, enc).ok().flatten().unwrap_or_default()
        };
        let url = format!("{}{}", self.base, fill(&lookup.path, &encode_segment));
        // The whole lookup, body included, within the caller's bound; the
        // connect within it, as for a call.
        let connect = self.cfg.connect_timeout_ms.min(timeout_ms - CONNECT_MARGIN_MS);
        let mut builder = self
            .agent
            .get(&url)
            .config()
            .timeout_global(Some(Duration::from_millis(timeout_ms)))
            .timeout_connect(Some(Duration::from_millis(connect)))
            .build();
        for (k, t) in &lookup.query {
            builder = builder.query(k, fill(t, &|x| x.to_string()));
        }
        for (h, t) in &lookup.headers {
            builder = builder.header(h, fill(t, &|x| x.to_string()));
        }
        for (h, v) in &self.secrets {
            builder = builder.header(h, v);
        }
        let mut resp = match builder.call() {
            Ok(r) => r,
            Err(e) => {
                tracing::info!(downstream = %self.name, error = %e, "http lookup failed");
                return Ok(Lookup::Unavailable);
            }
        };
        Ok(match resp.status().as_u16() {
            200..=299 => match self.read_body(&mut resp) {
                Ok(b) => self.receipt(&b, Vec::new()).map_or(Lookup::Unavailable, Lookup::Found),
                Err(_) => Lookup::Unavailable,
            },
            404 => Lookup::NotFound,
            _ => Lookup::Unavailable,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_445_412_480); // Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(retry_after_ms(Some("2"), now), Some(2_000));
        assert_eq!(retry_after_ms(Some("Wed, 21 Oct 2015 07:28:05 GMT"), now), Some(5_000));
        assert_eq!(retry_after_ms(Some("Wednesday, 21-Oct-15 07:28:07 GMT"), now), Some(7_000), "RFC 850");
        assert_eq!(retry_after_ms(Some("Wed Oct 21 07:28:09 2015"), now), Some(9_000), "asctime");
        assert_eq!(retry_after_ms(Some("Thu Oct  1 07:28:09 2015"), now), Some(0), "asctime, one-digit day, past");
        assert_eq!(retry_after_ms(Some("Wed, 21 Oct 2015 07:28:05"), now), None, "no zone");
        assert_eq!(retry_after_ms(Some("Wed Oct  1 07:28:09 2015"), now), None, "1 Oct 2015 was a Thursday");
        assert_eq!(retry_after_ms(Some("Wed, 21 Oct 2015 07:27:00 GMT"), now), Some(0));
        assert_eq!(retry_after_ms(Some("99999999999"), now), Some(MAX_RETRY_AFTER_MS));
        assert_eq!(retry_after_ms(Some("soon"), now), None);
        assert_eq!(retry_after_ms(None, now), None);
    }

    #[test]
    fn only_a_failure_before_the_send_counts_as_not_received() {
        // A name that does not resolve is classified here, not over the
        // network: the test machines' resolvers are not on loopback, and a
        // test may reach nothing else. The connect timeout and the refused
        // connection are also shown over loopback in tests/it/http.rs.
        use std::io::{Error as IoError, ErrorKind};
        let unavailable = Some(Reply::Unavailable { retry_after_ms: None });
        let check = |e: ureq::Error, expect: &Option<Reply>| assert_eq!(&not_received(&e), expect, "{e:?}");
        check(ureq::Error::HostNotFound, &unavailable);
        check(ureq::Error::Timeout(ureq::Timeout::Resolve), &Some(Reply::ConnectTimeout));
        check(ureq::Error::Timeout(ureq::Timeout::Connect), &Some(Reply::ConnectTimeout));
        check(ureq::Error::ConnectionFailed, &unavailable);
        check(ureq::Error::Io(IoError::from(ErrorKind::ConnectionRefused)), &unavailable);
        check(ureq::Error::Io(IoError::from(ErrorKind::BrokenPipe)), &unavailable);
        // Anything later may have reached the server: not "not received".
        for t in [ureq::Timeout::Global, ureq::Timeout::SendBody, ureq::Timeout::RecvResponse, ureq::Timeout::RecvBody]
        {
            check(ureq::Error::Timeout(t), &None);
        }
        check(ureq::Error::Io(IoError::from(ErrorKind::ConnectionReset)), &None);
        check(ureq::Error::Io(IoError::from(ErrorKind::UnexpectedEof)), &None);
    }

    #[test]
    fn keys_are_encoded_as_one_path_segment() {
        assert_eq!(encode_segment("dk2_ab/../x y"), "dk2_ab%2F..%2Fx%20y");
    }
}
