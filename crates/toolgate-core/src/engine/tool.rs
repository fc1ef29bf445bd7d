//! What the engine needs from a tool and from the system behind it, as traits:
//! a [`ToolDomain`] (which resource a call touches, the business rules of a new
//! execution, the local effect of a committed result) and a [`Downstream`]
//! (execute under a key, look up by key), opened per engine by a
//! [`DownstreamFactory`]. A [`Toolset`] carries a catalog with the domains and
//! adapters that serve it; the engine is handed one when it is built and never
//! names a tool, an order or a provider itself.
//!
//! Implementations live above the engine: the demo world in `crate::tools::demo`,
//! the simulated providers in `crate::downstream`, the HTTP adapter in
//! `crate::downstream::http`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::clock::Clock;
use super::contracts::{Contract, ContractError, Contracts, DownstreamRef, Effect};
use super::faults::FaultPlan;
use super::ids::Ids;
use crate::store::{DomainTx, StoreError};

/// The parts of a call a domain sees (arguments already schema-valid).
#[derive(Debug, Clone, Copy)]
pub struct ToolCall<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Subject the agent acts for.
    pub subject: &'a str,
    /// Tool name.
    pub tool: &'a str,
    /// Validated arguments.
    pub arguments: &'a Value,
    /// The operation the call belongs to, once accepted (`None` at admission):
    /// its own hold is not counted against it when its rules are checked again.
    pub operation_id: Option<&'a str>,
}

/// What a new execution reserves of a balance from its accept until it ends:
/// `amount` of `resource` (a name the domain chooses, e.g. `order:ord_1001`).
/// The engine writes it in the transaction that accepts the operation and
/// ends it when the operation becomes terminal: turned into the effect by
/// [`ToolDomain::apply`] when it succeeded, released when it ended with no
/// effect; while the outcome is unknown or under review it stays (the money
/// may be gone). A domain's [`ToolDomain::rules`] counts what is held
/// (`Tx::held_on`), so concurrent executions cannot grant the same balance twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The balance held on.
    pub resource: String,
    /// How much (positive).
    pub amount: i64,
}

/// A tool's business domain. Every method has the default of a tool with no
/// domain code (the common case for a real API): authorized by grants alone,
/// no rules beyond the schema, no local effect (the downstream's receipt is the
/// result). Methods run inside the ledger transaction of the step that asks, so
/// what they read and write commits or rolls back with it; they see it as a
/// [`DomainTx`]: the holds, and the domain's own tables, never the ledger's.
pub trait ToolDomain: Send + Sync {
    /// Whether the resource the call touches exists and the subject may see it.
    /// `false` answers `NOT_FOUND`: not owned, another tenant's and missing look
    /// the same (fail closed).
    fn visible(&self, _tx: &DomainTx<'_, '_>, _call: &ToolCall<'_>) -> Result<bool, StoreError> {
        Ok(true)
    }

    /// The business rules of a new execution (checked at admission and again
    /// before the send): `Some(rule)` refuses it as `BUSINESS_RULE_VIOLATION`
    /// with that rule name (a stable, lower-case identifier).
    fn rules(&self, _tx: &DomainTx<'_, '_>, _call: &ToolCall<'_>) -> Result<Option<&'static str>, StoreError> {
        Ok(None)
    }

    /// What a new execution of the call holds until it ends (see [`Hold`]);
    /// `None` for a call that grants from no balance. Asked only after
    /// [`ToolDomain::rules`] allowed the call, in the same transaction.
    fn hold(&self, _call: &ToolCall<'_>) -> Option<Hold> {
        None
    }

    /// The local effect of a committed result, in the transaction that records
    /// the result (from a reply, a status query or a human decision). `Some`
    /// is an anomaly the engine writes into the step's trace event (money paid
    /// above what the domain allowed): the effect is recorded as it happened,
    /// never clipped to look right.
    fn apply(
        &self,
        _tx: &DomainTx<'_, '_>,
        _call: &ToolCall<'_>,
        _result: &Value,
    ) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// Undoes [`ToolDomain::apply`] for a result the ledger took on wrong
    /// evidence (a receipt that was another operation's), when a person
    /// resolves the operation as having had no effect of its own. Nothing by
    /// default.
    fn revert(&self, _tx: &DomainTx<'_, '_>, _call: &ToolCall<'_>, _result: &Value) -> Result<(), StoreError> {
        Ok(())
    }

    /// What the resource the call touches looks like now, for an operator's
    /// detail view: (label, value) lines (an order's capture, refunds and
    /// holds). Read in the detail's read transaction; nothing by default.
    fn context(&self, _tx: &DomainTx<'_, '_>, _call: &ToolCall<'_>) -> Result<Vec<(String, String)>, StoreError> {
        Ok(Vec::new())
    }

    /// A read tool answered from local state; `None` when there is nothing to
    /// show (the caller gets `TOOL_ERROR`).
    fn read(&self, _tx: &DomainTx<'_, '_>, _call: &ToolCall<'_>) -> Result<Option<Value>, StoreError> {
        Ok(None)
    }

    /// The top-level sections of a world file that are this domain's (the
    /// demo's `orders`). A section no domain of the toolset claims is refused.
    fn world_sections(&self) -> &'static [&'static str] {
        &[]
    }

    /// Checks this domain's sections of a world file against the rest of it
    /// and, when given (at the load), the catalog: the first problem, as
    /// "record: field `f`: rule".
    fn check_world(&self, _world: &super::world::World, _catalog: Option<&Contracts>) -> Result<(), String> {
        Ok(())
    }

    /// Seeds the domain's own tables from a world file being loaded, in the
    /// transaction that loads it (all or nothing). Nothing by default.
    fn load_world(&self, _tx: &DomainTx<'_, '_>, _world: &super::world::World) -> Result<(), StoreError> {
        Ok(())
    }

    /// The integrity audit of the domain's local state against the calls the
    /// ledger holds as succeeded: `find(kind, id, what)` reports a finding.
    fn audit(
        &self,
        _tx: &DomainTx<'_, '_>,
        _succeeded: &[(ToolCall<'_>, Value)],
        _find: &mut dyn FnMut(&str, &str, &str),
    ) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The domain of a tool with no domain code.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDomain;

impl ToolDomain for NoDomain {}

/// What the engine sends downstream.
#[derive(Debug, Clone)]
pub struct DownstreamRequest {
    /// Business intent label (the hashed idempotency scope), for effect counting.
    pub intent: String,
    /// Tool name.
    pub tool: String,
    /// Validated arguments.
    pub arguments: Value,
    /// The request digest; a provider that records it beside the effect lets a
    /// receipt prove which request it is for.
    pub request_sha256: String,
    /// How long the caller waits for this attempt (the attempt timeout capped by
    /// the operation deadline).
    pub timeout_ms: u64,
}

/// Evidence of a committed effect.
#[derive(Clone, PartialEq, Eq)]
pub struct Receipt {
    /// Receipt id.
    pub receipt_id: String,
    /// Downstream request id.
    pub request_id: String,
    /// The request digest the provider recorded, when it records one (a real
    /// API usually does not: then the key is the only link, and the engine
    /// records the digest it sent under that key).
    pub body_sha256: Option<String>,
    /// The idempotency key the provider says the receipt was made under, when
    /// it echoes one: a receipt under another key is not this call's.
    pub key: Option<String>,
    /// The result body.
    pub result: Value,
    /// Reply headers, as a provider's HTTP reply carries them. The engine never
    /// stores, traces or logs them (they may echo credentials).
    pub headers: Vec<(String, String)>,
}

/// Redacted on purpose: a receipt formatted into a log line or a panic message
/// must not carry the result body or a header value.
impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let header_names: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("Receipt")
            .field("receipt_id", &self.receipt_id)
            .field("request_id", &self.request_id)
            .field("body_sha256", &self.body_sha256)
            .field("key", &self.key)
            .field("result", &"<redacted>")
            .field("headers", &header_names)
            .finish()
    }
}

/// What a downstream said when it refused a request: its HTTP status, the
/// digest of its body, and a bounded, redacted excerpt of it (see
/// [`Refusal::of_body`]). Recorded in the trace so that `ops show` tells the
/// operator why, without a packet capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status; 0 when the downstream is not HTTP (an MCP tool's
    /// `isError` result, its text content as the body).
    pub status: u16,
    /// SHA-256 of the whole body as received (hex).
    pub body_sha256: String,
    /// At most [`Refusal::EXCERPT_CHARS`] characters of the body, redacted.
    pub excerpt: String,
}

impl Refusal {
    /// The longest excerpt kept.
    pub const EXCERPT_CHARS: usize = 200;

    /// A refusal from a body. Redaction: every `secrets` value (the
    /// downstream's secret header values) is replaced by `[redacted]`, as is
    /// any word after `Bearer `/`Basic `; control characters become spaces;
    /// the text is cut at a character boundary with `…`.
    pub fn of_body(status: u16, body: &[u8], secrets: &[&str]) -> Self {
        let mut text = String::from_utf8_lossy(body).into_owned();
        for s in secrets.iter().filter(|s| s.len() >= 4) {
            text = text.replace(s, "[redacted]");
        }
        for scheme in ["Bearer ", "bearer ", "Basic ", "basic "] {
            let mut out = String::with_capacity(text.len());
            let mut rest = text.as_str();
            while let Some(i) = rest.find(scheme) {
                out.push_str(&rest[..i + scheme.len()]);
                rest = &rest[i + scheme.len()..];
                let end =
                    rest.find(|c: char| c.is_whitespace() || c == '"' || c == '\\' || c == '\'').unwrap_or(rest.len());
                if end > 0 {
                    out.push_str("[redacted]");
                }
                rest = &rest[end..];
            }
            out.push_str(rest);
            text = out;
        }
        let cleaned: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        let mut excerpt: String = cleaned.chars().take(Self::EXCERPT_CHARS).collect();
        if cleaned.chars().count() > Self::EXCERPT_CHARS {
            excerpt.push('…');
        }
        Refusal { status, body_sha256: crate::engine::canonical::sha256_hex(body), excerpt: excerpt.trim().to_string() }
    }
}

/// What an `execute` returned, as far as the caller can tell: classified by
/// the evidence of docs/design.md §7 (was the request provably not received, or
/// may it have committed?).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Committed, reply received.
    Committed(Receipt),
    /// Definitively refused: no effect.
    Rejected {
        /// Provider's reason (never stored or traced: it is raw reply text).
        reason: String,
        /// What an HTTP downstream's refusal said (status, body digest and
        /// redacted excerpt): traced.
        refusal: Option<Refusal>,
    },
    /// The downstream refused toolgate's own credentials (HTTP 401/403): the
    /// request was not processed, and no retry helps until an operator fixes
    /// the configuration (a rotated secret). Not received: the key stays
    /// usable.
    AuthRefused(Refusal),
    /// 429 with Retry-After: provably not accepted.
    RateLimited {
        /// Retry-After.
        retry_after_ms: u64,
    },
    /// 503 (or a 5xx the tool's configuration says means "not committed"):
    /// provably not accepted.
    Unavailable {
        /// Retry-After, when the provider sent one.
        retry_after_ms: Option<u64>,
    },
    /// The connection was never established (refused, connect timeout, name
    /// not resolved): provably not received.
    ConnectTimeout,
    /// Sent, no reply in time (or the connection dropped after the request was
    /// written): it may or may not have committed.
    TimedOut,
    /// A server error after the request was sent: it may have committed.
    ServerError,
    /// The tool ran and reported an error (an MCP `isError` result): it may
    /// have acted before it failed, so nothing is decided from it; what it
    /// said is the evidence (traced as the refusal is).
    ToolFailed(Refusal),
    /// The provider says the same key is still being processed: received, not
    /// finished; ask again later.
    InProgress {
        /// Retry-After, when the provider sent one.
        retry_after_ms: Option<u64>,
    },
    /// The provider says the key was used before with another request: the
    /// ledger and the provider disagree about what this key means.
    KeyConflict,
    /// A reply that cannot be parsed (the effect may exist).
    Malformed,
}

/// A status lookup by downstream key.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The provider has a receipt.
    Found(Receipt),
    /// Nothing (yet).
    NotFound,
    /// The lookup itself failed.
    Unavailable,
    /// The downstream has no lookup (the catalog says so): nothing can be asked.
    Unsupported,
    /// The downstream's answer does not settle the call as this request's: it
    /// holds another request under the key ("key in use with another body"),
    /// or refused the request re-sent. A person decides (`STATUS_CONFLICT`).
    Conflict(String),
}

/// Downstream errors that are not replies (the adapter's own storage or set-up failed).
#[derive(Debug, thiserror::Error)]
pub enum DownstreamError {
    /// Its storage failed.
    #[error("downstream storage: {0}")]
    Store(#[from] StoreError),
    /// It could not be set up (a missing secret, a bad URL).
    #[error("downstream {name}: {reason}")]
    Setup {
        /// Downstream name.
        name: String,
        /// What is wrong (no secret values, no local paths).
        reason: String,
    },
}

/// What a provider that can count its own effects tells a referee.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectCounts {
    /// Committed effects.
    pub effects: i64,
    /// Business intents with more than one committed effect (must be 0).
    pub duplicates: i64,
}

/// The adapter every downstream implements.
pub trait Downstream: Send {
    /// Executes a request under a downstream key.
    fn execute(&mut self, downstream_key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError>;
    /// Looks up what happened under a downstream key, waiting at most
    /// `timeout_ms` for the answer (the tool's attempt timeout: a lookup is
    /// bounded like a call; past it the lookup is [`Lookup::Unavailable`]).
    fn lookup(&mut self, downstream_key: &str, timeout_ms: u64) -> Result<Lookup, DownstreamError>;
    /// The effects this provider committed, for a referee (the console's
    /// duplicate counter, the lab, `counts`): only a provider that can count
    /// them from its own records answers (the simulated ones). The engine never
    /// reads a provider's storage itself.
    fn effect_counts(&mut self) -> Result<Option<EffectCounts>, DownstreamError> {
        Ok(None)
    }
    /// The effects this downstream alone committed (`toolgate counts`, per
    /// downstream; [`Downstream::effect_counts`] may answer for several):
    /// `None` when it cannot count them (a real API's adapter).
    fn own_effect_counts(&mut self) -> Result<Option<EffectCounts>, DownstreamError> {
        Ok(None)
    }
    /// Effects this provider committed for one business intent (the lab's referee).
    fn effects_for_intent(&mut self, _intent: &str) -> Result<Option<i64>, DownstreamError> {
        Ok(None)
    }
    /// Money this provider paid out per order (minor units), when it pays
    /// money (the lab's and the load referee's money check).
    fn paid_by_order(&mut self) -> Result<Option<BTreeMap<String, i64>>, DownstreamError> {
        Ok(None)
    }

    /// Learns the world the ledger was initialised with (a simulated payments
    /// provider records the charges of its orders); most adapters ignore it.
    fn load_world(&mut self, _world: &super::world::World) -> Result<(), DownstreamError> {
        Ok(())
    }
}

/// What an adapter may use when an engine opens it.
pub struct DownstreamContext<'a> {
    /// The ledger the engine is on (a simulated provider keeps its tables beside it).
    pub ledger_path: &'a Path,
    /// The engine's clock.
    pub clock: Arc<dyn Clock>,
    /// The fault plan the engine's `set_faults` changes (simulated providers).
    pub faults: Arc<Mutex<FaultPlan>>,
    /// Durability of the ledger.
    pub sync: crate::store::Sync,
    /// The engine's id source.
    pub ids: Ids,
    /// The engine is read-only: the adapter must not write.
    pub read_only: bool,
}

/// The downstreams an engine opened, by name, and (read-only engines only)
/// those it could not open, with why.
#[derive(Default)]
pub(crate) struct OpenedDownstreams {
    pub(crate) open: BTreeMap<String, Box<dyn Downstream>>,
    pub(crate) unopened: BTreeMap<String, String>,
}

/// Opens one downstream per engine from the catalog's `downstream` section.
pub trait DownstreamFactory: Send + Sync {
    /// Checks the tool's downstream section when the toolset is built (the
    /// whole contract: what binds a lookup's answer may be the tool's
    /// `result_echoes`); `Err(field, why)` refuses the catalog
    /// (`CATALOG_INVALID`), the field relative to `downstream`. A `read` tool
    /// naming the adapter is answered by its `execute` with an empty key and
    /// nothing recorded: an adapter that cannot answer reads refuses it here.
    fn check(&self, contract: &Contract) -> Result<(), (String, String)>;
    /// Every problem of the tool's downstream section at once (the loader
    /// reports them together); by default the one [`DownstreamFactory::check`] finds.
    fn check_all(&self, contract: &Contract) -> Vec<(String, String)> {
        self.check(contract).err().into_iter().collect()
    }
    /// Opens an instance for one engine.
    fn open(
        &self,
        downstream: &DownstreamRef,
        ctx: &DownstreamContext<'_>,
    ) -> Result<Box<dyn Downstream>, DownstreamError>;
}

/// The adapter name of a tool answered locally by its domain (reads).
pub const LOCAL_ADAPTER: &str = "local";

/// A catalog with the domains and adapters that serve it.
#[derive(Clone)]
pub struct Toolset {
    catalog: Arc<Contracts>,
    domains: BTreeMap<String, Arc<dyn ToolDomain>>,
    adapters: BTreeMap<String, Arc<dyn DownstreamFactory>>,
}

impl std::fmt::Debug for Toolset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Toolset")
            .field("tools", &self.catalog.all().iter().map(|c| c.name.as_str()).collect::<Vec<_>>())
            .field("domains", &self.domains.keys().collect::<Vec<_>>())
            .field("adapters", &self.adapters.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Builds a [`Toolset`]: add the adapters and domains, then [`ToolsetBuilder::build`]
/// checks that every tool of the catalog is served.
pub struct ToolsetBuilder {
    catalog: Arc<Contracts>,
    domains: BTreeMap<String, Arc<dyn ToolDomain>>,
    adapters: BTreeMap<String, Arc<dyn DownstreamFactory>>,
}

impl ToolsetBuilder {
    /// A downstream adapter under the name the catalog's `downstream.adapter` uses.
    #[must_use]
    pub fn adapter(mut self, name: &str, factory: Arc<dyn DownstreamFactory>) -> Self {
        self.adapters.insert(name.to_string(), factory);
        self
    }

    /// A domain for these tools (tools the catalog does not hold are ignored:
    /// one domain can serve a world that a catalog only partly uses).
    #[must_use]
    pub fn domain(mut self, tools: &[&str], domain: &Arc<dyn ToolDomain>) -> Self {
        for t in tools {
            self.domains.insert((*t).to_string(), Arc::clone(domain));
        }
        self
    }

    /// Checks that every tool's adapter exists and accepts its section, and that
    /// a locally answered tool has a domain.
    pub fn build(self) -> Result<Toolset, ContractError> {
        // Every tool's problems at once, like the catalog loader's.
        let mut problems = Vec::new();
        for c in self.catalog.all() {
            let d = &c.downstream;
            let mut invalid = |field: String, reason: String| {
                problems.push(ContractError::Invalid { file: c.file.clone(), field, reason });
            };
            if d.adapter == LOCAL_ADAPTER {
                if c.effect != Effect::Read {
                    invalid(
                        "downstream.adapter".into(),
                        "a write or external tool needs a downstream that executes it, not `local`".into(),
                    );
                }
                if !self.domains.contains_key(&c.name) {
                    invalid(
                        "downstream.adapter".into(),
                        format!("`local` needs a domain that answers {}; none is registered", c.name),
                    );
                }
                continue;
            }
            // A read tool with another adapter is answered by that adapter's
            // `execute` (nothing is recorded, nothing queued); the adapter's
            // check says whether it can answer reads.
            let Some(f) = self.adapters.get(&d.adapter) else {
                let known: Vec<&str> = self.adapters.keys().map(String::as_str).collect();
                invalid(
                    "downstream.adapter".into(),
                    format!("unknown adapter {:?} (known: local, {})", d.adapter, known.join(", ")),
                );
                continue;
            };
            for (field, why) in f.check_all(c) {
                invalid(format!("downstream.{field}"), why);
            }
        }
        ContractError::all(problems)?;
        Ok(Toolset { catalog: self.catalog, domains: self.domains, adapters: self.adapters })
    }
}

impl Toolset {
    /// Starts a toolset over a catalog.
    pub fn builder(catalog: Arc<Contracts>) -> ToolsetBuilder {
        ToolsetBuilder { catalog, domains: BTreeMap::new(), adapters: BTreeMap::new() }
    }

    /// The catalog.
    pub fn catalog(&self) -> &Arc<Contracts> {
        &self.catalog
    }

    /// The domain of a tool ([`NoDomain`] when it has none).
    pub fn domain(&self, tool: &str) -> Arc<dyn ToolDomain> {
        self.domains.get(tool).cloned().unwrap_or_else(|| Arc::new(NoDomain))
    }

    /// Refuses a world file this toolset cannot serve: a section no domain
    /// claims (as serde words an unknown field), or what a domain refuses in
    /// its own sections; `file` names the file in the message.
    pub fn check_world(
        &self,
        file: &str,
        world: &super::world::World,
        catalog: Option<&Contracts>,
    ) -> Result<(), super::EngineError> {
        let groups = self.domain_groups();
        for name in world.sections.keys() {
            if !groups.iter().any(|(_, d)| d.world_sections().contains(&name.as_str())) {
                let mut known: Vec<&str> = super::world::CORE_SECTIONS.to_vec();
                for (_, d) in &groups {
                    known.extend(d.world_sections());
                }
                let known: Vec<String> = known.iter().map(|k| format!("`{k}`")).collect();
                return Err(super::world::bad(format!(
                    "{file}: unknown field `{name}`, expected one of {}",
                    known.join(", ")
                )));
            }
        }
        for (_, d) in &groups {
            d.check_world(world, catalog).map_err(|why| super::world::bad(format!("{file}: {why}")))?;
        }
        Ok(())
    }

    /// Each distinct domain with the tools it serves (for the audit).
    pub fn domain_groups(&self) -> Vec<(Vec<String>, Arc<dyn ToolDomain>)> {
        let mut groups: Vec<(Vec<String>, Arc<dyn ToolDomain>)> = Vec::new();
        for (tool, d) in &self.domains {
            match groups.iter_mut().find(|(_, g)| Arc::ptr_eq(g, d)) {
                Some((tools, _)) => tools.push(tool.clone()),
                None => groups.push((vec![tool.clone()], d.clone())),
            }
        }
        groups
    }

    /// Opens one instance of every downstream the catalog names, by downstream
    /// name. For a read-only engine a downstream that cannot be opened (its
    /// environment variables unset, its storage absent or older than this
    /// build) is no error: a read needs none, so it is left out and the
    /// second map says why (what needs it then says it was not checked).
    /// `skip`: downstreams not to open, with why (a read-only engine's only).
    pub(crate) fn open_downstreams(
        &self,
        ctx: &DownstreamContext<'_>,
        skip: &BTreeMap<String, String>,
    ) -> Result<OpenedDownstreams, DownstreamError> {
        let mut out = OpenedDownstreams { open: BTreeMap::new(), unopened: skip.clone() };
        for c in self.catalog.all() {
            let d = &c.downstream;
            if d.adapter == LOCAL_ADAPTER || out.open.contains_key(&d.name) || out.unopened.contains_key(&d.name) {
                continue;
            }
            if let Some(f) = self.adapters.get(&d.adapter) {
                match f.open(d, ctx) {
                    Ok(opened) => {
                        out.open.insert(d.name.clone(), opened);
                    }
                    Err(e) if ctx.read_only => {
                        out.unopened.insert(d.name.clone(), e.to_string());
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(out)
    }

    /// Every downstream the catalog names (not `local`), with its adapter.
    pub fn downstream_adapters(&self) -> BTreeMap<String, String> {
        self.catalog
            .all()
            .iter()
            .filter(|c| c.downstream.adapter != LOCAL_ADAPTER)
            .map(|c| (c.downstream.name.clone(), c.downstream.adapter.clone()))
            .collect()
    }
}
