//! The dispatcher engine: dispatch pipeline, ledger, outbox and leases, recovery
//! (status queries, approvals, human review), contracts and canonical form.
//!
//! The engine is UI-free: the console and the CLI are two clients of this API.
//! It never touches SQL directly: every read and write goes through
//! [`crate::store::Tx`].

pub mod bulk;
pub mod bulkhead;
mod cancel;
pub mod canonical;
pub mod clock;
pub mod contracts;
mod dispatch;
pub mod envelope;
pub mod faults;
pub mod ids;
pub mod lab;
pub mod ledger_clock;
pub(crate) mod operation;
pub use operation::intent_of;
mod audit;
pub mod policy;
pub mod projection;
mod recovery;
pub mod retention;
pub mod tokens;
pub mod tool;
pub mod trace;
pub mod views;
pub mod world;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value;

pub use audit::AuditFinding;
pub use bulk::{BulkAction, BulkItem, BulkReport, BulkTarget};
pub use cancel::{CancelRequest, CancelSignal};
pub use dispatch::{DispatchRequest, ReapReport};
pub use lab::{LabSide, LabState, LabToggle};
pub use operation::approval_amount;
pub use recovery::{OperationDetail, OperatorOutcome, QueryRequest, Resolution, ResolveRequest};
pub use retention::PurgeReport;
pub use trace::TraceEvent;

use crate::store::{OpenOptions, Store, StoreError, Sync, Tx};
use canonical::{sha256_hex, CallIdentity, StatusRefKey};
use clock::{Clock, SystemClock};
use contracts::{ContractError, Contracts};
use envelope::{Code, Delivery, Envelope, ErrorInfo, Execution, ModelResult, Outcome, ProtectedAudit, Status};
use faults::FaultPlan;
use tool::{Downstream, DownstreamContext, DownstreamError, Toolset};

/// Environment errors (the database or a provider's storage failed). Expected
/// outcomes of a call (a conflict, a replay, an unknown outcome) are never errors:
/// they are [`Envelope`]s.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Storage.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A downstream's own storage.
    #[error(transparent)]
    Downstream(#[from] DownstreamError),
    /// The contract catalog is broken.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// A world file or operator request was refused.
    #[error("{message}")]
    Invalid {
        /// Stable code.
        code: &'static str,
        /// Message (no local paths).
        message: String,
    },
}

impl crate::Coded for EngineError {
    /// Stable code for the CLI.
    fn code(&self) -> &'static str {
        match self {
            EngineError::Store(e) => e.code(),
            EngineError::Downstream(DownstreamError::Setup { .. }) => "DOWNSTREAM_SETUP",
            EngineError::Downstream(_) => "DOWNSTREAM_STORAGE",
            EngineError::Contract(_) => "CATALOG_INVALID",
            EngineError::Invalid { code, .. } => code,
        }
    }
}

impl EngineError {
    /// Bad input refused with a stable `code` (`INVALID_ARGUMENTS`, …) and a
    /// message for a person.
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        EngineError::Invalid { code, message: message.into() }
    }
}

/// Longest operator or approver name accepted.
pub const MAX_NAME_CHARS: usize = 128;
/// Longest part of a call identity accepted (provider, API family, response id, call id, adapter revision).
pub const MAX_CALL_PART_CHARS: usize = 256;
/// Longest operator note accepted.
pub const MAX_NOTE_CHARS: usize = 4096;

/// The one validation of a call identity (dispatch, status query): every
/// part is printed on screens and stored, so bounded and free of control
/// characters. `Err((part, why))` names the first part that is not.
pub fn check_call_identity(call: &canonical::CallIdentity) -> Result<(), (&'static str, String)> {
    for (part, value) in [
        ("provider", &call.provider),
        ("api_family", &call.api_family),
        ("response_id", &call.response_id),
        ("call_id", &call.call_id),
        ("adapter_revision", &call.adapter_revision),
    ] {
        check_name(part, value, MAX_CALL_PART_CHARS).map_err(|why| (part, why))?;
    }
    Ok(())
}

/// Checks a name a person or a caller gives (an operator, an approver, a
/// part of a call identity): not empty, at most `max` characters, no control
/// characters or bidirectional overrides (it would print as something else),
/// and not the shape of a principal reference (`pr_` + 16 hex digits, which
/// the audit log uses for a caller's own status query).
pub fn check_name(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.trim().is_empty() {
        return Err(format!("{what} is empty"));
    }
    if s.chars().count() > max {
        return Err(format!("{what} is longer than {max} characters"));
    }
    if s.chars().any(|c| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')) {
        return Err(format!("{what} contains control characters"));
    }
    if s.len() == 19 && s.starts_with("pr_") && s[3..].bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("{what} has the shape of a principal reference (pr_ + 16 hex digits), which is reserved"));
    }
    Ok(())
}

/// Checks an operator note: at most [`MAX_NOTE_CHARS`], line breaks and tabs
/// allowed (every display escapes them), no other control characters.
pub fn check_note(s: &str) -> Result<(), String> {
    if s.chars().count() > MAX_NOTE_CHARS {
        return Err(format!("the note is longer than {MAX_NOTE_CHARS} characters"));
    }
    if s.chars().any(|c| {
        (c.is_control() && c != '\n' && c != '\t') || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }) {
        return Err("the note contains control characters other than line breaks".into());
    }
    Ok(())
}

/// [`check_name`] for an operator action: `INVALID_OPERATOR`, nothing recorded.
pub(crate) fn check_operator(s: &str) -> Result<(), EngineError> {
    check_name("the operator name", s, MAX_NAME_CHARS).map_err(|m| EngineError::invalid("INVALID_OPERATOR", m))
}

/// [`check_note`] for an operator action: `INVALID_NOTE`, nothing recorded.
pub(crate) fn check_operator_note(s: &str) -> Result<(), EngineError> {
    check_note(s).map_err(|m| EngineError::invalid("INVALID_NOTE", m))
}

/// How to open an engine.
pub struct EngineOptions {
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// Durability of the ledger.
    pub sync: Sync,
    /// This worker's lease-owner name.
    pub worker_id: String,
    /// The tools: a catalog with the domains and downstream adapters that
    /// serve it (`tools::demo_options()` is the demo toolset's).
    pub toolset: Arc<Toolset>,
    /// Replaces the toolset's catalog (tests and the lab change revisions with it).
    pub contracts: Option<Arc<Contracts>>,
    /// Seed for ids, secrets and jitter (deterministic runs); OS entropy when absent.
    pub seed: Option<u64>,
    /// Classroom / lab toggles that switch individual defenses off. All off (every
    /// defense on) by default; never set them on a ledger that matters.
    pub defenses_off: DefensesOff,
}

impl EngineOptions {
    /// The options of an engine serving `toolset`: the system clock, a
    /// `synchronous=FULL` ledger, a random worker id, the toolset's own catalog,
    /// OS entropy and every defense on. Set the other fields with struct update
    /// syntax: `EngineOptions { clock, ..EngineOptions::new(toolset) }`.
    pub fn new(toolset: Arc<Toolset>) -> Self {
        Self {
            clock: Arc::new(SystemClock),
            sync: Sync::Full,
            worker_id: format!("w{}-{}", std::process::id(), hex::encode(rand::random::<[u8; 4]>())),
            toolset,
            contracts: None,
            seed: None,
            defenses_off: DefensesOff::default(),
        }
    }
}

/// Lab mode: each `true` switches one defense off so that a class (or a test of
/// the checker) can watch duplicates appear. `DefensesOff::default()` is the
/// production setting: every field `false`, every defense on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DefensesOff {
    /// Every delivery attempt gets its own downstream idempotency key (the
    /// operation's key plus the attempt number) instead of the operation's one
    /// stable key. An attempt re-sent after a crash then looks like a new request
    /// to the payments provider, which commits a second effect.
    pub unique_downstream_key_per_attempt: bool,
    /// Lab (`server_generated_key`): the ledger scope key is minted by the server
    /// for every call, so a caller's retry is a new intent to the ledger.
    pub server_generated_key: bool,
    /// Lab (`conflict_returns_old_result`): the same key with other arguments
    /// answers the stored result instead of `IDEMPOTENCY_CONFLICT`.
    pub conflict_returns_old_result: bool,
    /// Lab (`in_memory_ledger`): the scope key carries this engine instance's id,
    /// as if the records lived in the process: a restart forgets every key.
    pub in_memory_ledger: bool,
    /// Lab (`naive_timeout_retry`): a response timeout is retried like a
    /// refusal instead of being parked as `OUTCOME_UNKNOWN`.
    pub naive_timeout_retry: bool,
    /// Lab (`balance_not_reserved`): an accepted operation holds nothing of
    /// the balance its rule granted from, so concurrent refunds of one order
    /// all see the same remaining amount.
    pub balance_not_reserved: bool,
}

impl DefensesOff {
    /// Every defense either switches off.
    #[must_use]
    pub fn or(self, other: DefensesOff) -> DefensesOff {
        DefensesOff {
            unique_downstream_key_per_attempt: self.unique_downstream_key_per_attempt
                || other.unique_downstream_key_per_attempt,
            server_generated_key: self.server_generated_key || other.server_generated_key,
            conflict_returns_old_result: self.conflict_returns_old_result || other.conflict_returns_old_result,
            in_memory_ledger: self.in_memory_ledger || other.in_memory_ledger,
            naive_timeout_retry: self.naive_timeout_retry || other.naive_timeout_retry,
            balance_not_reserved: self.balance_not_reserved || other.balance_not_reserved,
        }
    }
}

/// Counts of what is in a database (`toolgate counts`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// Operations per state.
    pub operations: std::collections::BTreeMap<String, i64>,
    /// Outbox rows per state.
    pub outbox: std::collections::BTreeMap<String, i64>,
    /// Committed downstream effects, as counted by the downstreams that can
    /// count them (the simulated providers; never a real API's: see
    /// `downstreams`).
    pub downstream_effects: i64,
    /// Intents with more than one effect (must be 0), at the same downstreams
    /// as `downstream_effects`: 0 says nothing about one that is not counted.
    pub side_effect_duplicates: i64,
    /// Per downstream of the catalog: whether its effects were counted, and
    /// what was counted there.
    pub downstreams: std::collections::BTreeMap<String, DownstreamEffects>,
    /// Pending approvals.
    pub pending_approvals: i64,
    /// The ledger's one clock (absent under a manual clock: tests, `--now`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock: Option<ledger_clock::ClockStatus>,
}

/// What `counts` can say about one downstream's effects.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DownstreamEffects {
    /// Its adapter (`simulated`, `http`, an embedder's).
    pub adapter: String,
    /// Whether its effects were counted here; when not, the two counts are
    /// `null` and `note` says why and where to count them.
    pub counted: bool,
    /// Effects it committed.
    pub effects: Option<i64>,
    /// Its business intents with more than one committed effect (must be 0).
    pub side_effect_duplicates: Option<i64>,
    /// Why it was not counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The dispatcher. One per thread: it owns one connection (and one per provider).
pub struct Engine {
    pub(crate) store: Store,
    pub(crate) contracts: Arc<Contracts>,
    pub(crate) clock: Arc<dyn Clock>,
    /// The ledger's one clock, when `clock` is it (not a manual clock).
    pub(crate) ledger_clock: Option<Arc<ledger_clock::LedgerClock>>,
    pub(crate) refs: StatusRefKey,
    pub(crate) salt: String,
    pub(crate) worker_id: String,
    pub(crate) toolset: Arc<Toolset>,
    pub(crate) downstreams: std::collections::BTreeMap<String, Box<dyn Downstream>>,
    /// The downstreams a read-only engine could not open, with why (a read
    /// needs no downstream: what would ask one says it was not checked).
    pub(crate) unopened: std::collections::BTreeMap<String, String>,
    pub(crate) faults: Arc<Mutex<FaultPlan>>,
    pub(crate) ids: ids::Ids,
    pub(crate) defenses_off: DefensesOff,
    /// The file is marked as a demo (lab toggles are honoured).
    pub(crate) demo: bool,
    /// This engine instance's id: what an in-memory ledger would be scoped to.
    pub(crate) instance: String,
    /// Scopes this engine has answered with an operation (a hint, see [`dispatch::SeenSent`]).
    pub(crate) seen_sent: dispatch::SeenSent,
    pub(crate) path: PathBuf,
    /// The tenants the operator acting now may reach (`None`: all). Set by
    /// a server around one operator request made with a scoped token; an
    /// operation or approval of another tenant is then as if it did not exist.
    pub(crate) operator_scope: Option<Vec<String>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("worker_id", &self.worker_id).finish_non_exhaustive()
    }
}

impl Engine {
    /// Creates a new database (or opens an existing one) with its secrets.
    pub fn create(path: &Path, opts: EngineOptions) -> Result<Self, EngineError> {
        Self::open_with(path, opts, Some(true))
    }

    /// Opens an existing database.
    pub fn open(path: &Path, opts: EngineOptions) -> Result<Self, EngineError> {
        Self::open_with(path, opts, Some(false))
    }

    /// Opens an existing ledger for reading only (read commands, the console
    /// with `--read-only`): never creates, migrates or writes the file; a file
    /// that is not a ledger is `DB_NOT_TOOLGATE`; every state change through
    /// this engine is `DB_READ_ONLY`.
    pub fn open_read_only(path: &Path, opts: EngineOptions) -> Result<Self, EngineError> {
        Self::open_with(path, opts, None)
    }

    fn open_with(path: &Path, opts: EngineOptions, create: impl Into<Option<bool>>) -> Result<Self, EngineError> {
        let ids = opts.seed.map_or_else(ids::Ids::default, ids::Ids::seeded);
        let faults = Arc::new(Mutex::new(FaultPlan::none()));
        let create: Option<bool> = create.into();
        let read_only = create.is_none();
        let mut store = match create {
            Some(create) => Store::open(path, OpenOptions { create, sync: opts.sync })?,
            None => Store::open_read_only(path)?,
        };
        // The host's wall clock is replaced by the ledger's one clock.
        let (clock, ledger_clock): (Arc<dyn Clock>, _) = if opts.clock.is_host_wall() {
            let lc = Arc::new(ledger_clock::open(&mut store, Arc::new(ledger_clock::RealHost))?);
            (lc.clone(), Some(lc))
        } else {
            (opts.clock.clone(), None)
        };
        let adapters = opts.toolset.downstream_adapters();
        // A read with another catalog than the ledger's (the built-in demo
        // one, for want of `--catalog`) does not open what it names under
        // another adapter: that would be some other system's storage.
        let foreign = if read_only { foreign_downstreams(&mut store, &adapters) } else { BTreeMap::new() };
        let opened = opts.toolset.open_downstreams(
            &DownstreamContext {
                ledger_path: path,
                clock: clock.clone(),
                faults: faults.clone(),
                sync: opts.sync,
                ids: ids.clone(),
                read_only,
            },
            &foreign,
        )?;
        let now = clock.now_ms();
        let contracts = match opts.contracts {
            Some(c) => c,
            None => opts.toolset.catalog().clone(),
        };
        let revisions = contract_revision_entries(&contracts);
        let (secret, salt, demo) = if store.is_read_only() {
            store.read(|tx| -> Result<_, StoreError> {
                let (Some(secret), Some(salt)) = (tx.meta("status_ref_secret")?, tx.meta("export_salt")?) else {
                    return Err(StoreError::NotToolgate);
                };
                Ok((secret, salt, tx.meta("demo")?.as_deref() == Some("1")))
            })?
        } else {
            store.write(|tx| -> Result<_, EngineError> {
                let secret = tx.meta_init("status_ref_secret", &hex::encode(ids.bytes::<32>()))?;
                let salt = tx.meta_init("export_salt", &hex::encode(ids.bytes::<16>()))?;
                tx.meta_init("created_at", &now.to_string())?;
                check_contract_revisions(tx, &revisions)?;
                record_downstream_adapters(tx, &adapters)?;
                Ok((secret, salt, tx.meta("demo")?.as_deref() == Some("1")))
            })?
        };
        Ok(Self {
            store,
            contracts,
            clock,
            ledger_clock,
            refs: StatusRefKey::new(secret.as_bytes()),
            salt,
            worker_id: opts.worker_id,
            toolset: opts.toolset,
            downstreams: opened.open,
            unopened: opened.unopened,
            faults,
            ids,
            defenses_off: opts.defenses_off,
            demo,
            // Not from `ids`: a seeded engine's id sequence must not depend on it.
            instance: hex::encode(rand::random::<[u8; 6]>()),
            seen_sent: dispatch::SeenSent::default(),
            path: path.to_path_buf(),
            operator_scope: None,
        })
    }

    /// Limits the operator actions and reads that follow to some tenants
    /// (`None`: every tenant) until set again: what a tenant-scoped operator
    /// token may reach. Another tenant's operation or approval is then
    /// answered as one that does not exist.
    pub fn set_operator_scope(&mut self, tenants: Option<Vec<String>>) {
        self.operator_scope = tenants;
    }

    /// Whether the operator acting now may reach this tenant.
    pub(crate) fn in_operator_scope(scope: Option<&[String]>, tenant: &str) -> bool {
        scope.is_none_or(|s| s.iter().any(|t| t == tenant))
    }

    /// The database path this engine is on.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The tool catalog.
    pub fn contracts(&self) -> &Contracts {
        &self.contracts
    }

    /// Commits of this process's writers on this ledger that waited for the
    /// disk (a group commit counts once), all time: `toolgate bench` reports
    /// them per call. The engine still hands out no store.
    pub fn synced_commits(&self) -> u64 {
        self.store.synced_commits()
    }

    /// Write transactions this process ran again on this ledger after a
    /// serialization failure, deadlock or unique violation (PostgreSQL; 0 on
    /// SQLite), all time.
    pub fn write_retries(&self) -> u64 {
        self.store.write_retries()
    }

    /// Replaces the tool catalog (a contract revision change).
    pub fn set_contracts(&mut self, contracts: Arc<Contracts>) {
        self.contracts = contracts;
    }

    /// Sets the faults the next downstream calls meet.
    pub fn set_faults(&self, plan: FaultPlan) {
        if let Ok(mut f) = self.faults.lock() {
            *f = plan;
        }
    }

    /// A read-only view of the ledger in one consistent snapshot (console, CLI
    /// listings, metrics): every change goes through the engine's own steps.
    pub fn read<T, E: From<StoreError>>(&mut self, f: impl FnMut(&Tx<'_>) -> Result<T, E>) -> Result<T, E> {
        self.store.read(f)
    }

    /// Marks the ledger as a demo database (the lab's toggles are allowed on it
    /// and nowhere else), generated up to `generated_until` (the working copy
    /// re-bases its times from there).
    pub fn mark_demo(&mut self, generated_until: i64) -> Result<(), EngineError> {
        let until = generated_until.to_string();
        self.store.write(|tx| -> Result<(), StoreError> {
            tx.meta_set("demo", "1")?;
            tx.meta_set("demo_generated_until", &until)
        })?;
        Ok(())
    }

    /// The downstreams this read-only engine could not open, by name, with
    /// why (empty for an engine that may write: it opens every one or fails).
    pub fn unopened_downstreams(&self) -> &std::collections::BTreeMap<String, String> {
        &self.unopened
    }

    /// The downstream a tool's catalog entry names (opened when the engine was).
    pub(crate) fn downstream(&mut self, name: &str) -> Result<&mut dyn Downstream, EngineError> {
        match self.downstreams.get_mut(name) {
            Some(d) => Ok(d.as_mut()),
            None => Err(EngineError::invalid("UNKNOWN_DOWNSTREAM", "the catalog names no adapter for this downstream")),
        }
    }

    /// The domain of a tool.
    pub(crate) fn domain(&self, tool: &str) -> Arc<dyn tool::ToolDomain> {
        self.toolset.domain(tool)
    }

    /// A hashed principal reference (tenant + subject), salted per database.
    pub fn principal_ref(&self, tenant: &str, subject: &str) -> String {
        let h = sha256_hex(format!("{}\0{tenant}\0{subject}", self.salt).as_bytes());
        format!("pr_{}", &h[..16])
    }

    /// A salted hash of one identifier, for traces and exports.
    pub fn hashed(&self, kind: &str, value: &str) -> String {
        trace::salted(&self.salt, kind, value)
    }

    /// Counts of operations, outbox rows, effects and duplicates.
    pub fn counts(&mut self) -> Result<Counts, EngineError> {
        let referee = self.effect_counts()?;
        let downstreams = self.effects_per_downstream()?;
        let clock = self.clock_status();
        let mut counts = self.store.read(|tx| -> Result<_, StoreError> {
            Ok(Counts {
                operations: tx.count_operations_by_state()?.into_iter().collect(),
                outbox: tx.count_outbox_by_state()?.into_iter().collect(),
                downstream_effects: referee.effects,
                side_effect_duplicates: referee.duplicates,
                downstreams: downstreams.clone(),
                pending_approvals: tx.pending_approvals(i64::MAX)?.len() as i64,
                clock: None,
            })
        })?;
        counts.clock = clock;
        Ok(counts)
    }

    /// Each downstream of the catalog, with what it can say of its own effects.
    fn effects_per_downstream(&mut self) -> Result<std::collections::BTreeMap<String, DownstreamEffects>, EngineError> {
        let mut out = std::collections::BTreeMap::new();
        for (name, adapter) in self.toolset.downstream_adapters() {
            let not_counted = |note: String| DownstreamEffects {
                adapter: adapter.clone(),
                counted: false,
                effects: None,
                side_effect_duplicates: None,
                note: Some(note),
            };
            let row = if let Some(why) = self.unopened.get(&name) {
                not_counted(format!("not opened by this read (a read needs no downstream): {why}"))
            } else {
                match self.downstreams.get_mut(&name).map(|d| d.own_effect_counts()).transpose()?.flatten() {
                    Some(c) => DownstreamEffects {
                        adapter: adapter.clone(),
                        counted: true,
                        effects: Some(c.effects),
                        side_effect_duplicates: Some(c.duplicates),
                        note: None,
                    },
                    None => not_counted(
                        "its adapter cannot count the effects it caused (a real API): count them at the provider \
                         (e.g. `toolgate load --provider-db`)"
                            .into(),
                    ),
                }
            };
            out.insert(name, row);
        }
        Ok(out)
    }

    /// The effects the providers committed, as the first downstream that can
    /// count them says (the simulated providers keep one set of counters for
    /// both of them); zero when none can (a real API's adapter cannot: count
    /// at the provider, as `toolgate load --provider-db` does).
    pub fn effect_counts(&mut self) -> Result<tool::EffectCounts, EngineError> {
        for d in self.downstreams.values_mut() {
            if let Some(c) = d.effect_counts()? {
                return Ok(c);
            }
        }
        Ok(tool::EffectCounts::default())
    }

    /// Grants a tool to a subject.
    pub fn grant(&mut self, tenant: &str, subject: &str, tool: &str) -> Result<bool, EngineError> {
        self.check_principal(tenant, subject, tool)?;
        let now = self.clock.now_ms();
        Ok(self.store.write(|tx| tx.grant(tenant, subject, tool, now))?)
    }

    /// Revokes a tool from a subject. Takes effect on the next check: nothing is cached.
    pub fn revoke(&mut self, tenant: &str, subject: &str, tool: &str) -> Result<bool, EngineError> {
        self.check_principal(tenant, subject, tool)?;
        let now = self.clock.now_ms();
        Ok(self.store.write(|tx| tx.revoke(tenant, subject, tool, now))?)
    }

    fn check_principal(&mut self, tenant: &str, subject: &str, tool: &str) -> Result<(), EngineError> {
        if self.contracts.get(tool).is_none() {
            return Err(EngineError::invalid("UNKNOWN_TOOL", "no such tool"));
        }
        let t = self.store.read(|tx| tx.subject_tenant(subject))?;
        if t.as_deref() != Some(tenant) {
            return Err(EngineError::invalid("UNKNOWN_SUBJECT", "no such subject in that tenant"));
        }
        Ok(())
    }

    /// Bumps a tenant's policy revision: pending approvals bound to the old one
    /// become invalid.
    pub fn bump_policy_revision(&mut self, tenant: &str) -> Result<(), EngineError> {
        let ok = self.store.write(|tx| tx.bump_policy_revision(tenant))?;
        if ok {
            Ok(())
        } else {
            Err(EngineError::invalid("UNKNOWN_TENANT", "no such tenant"))
        }
    }
}

/// The meta key that records which adapter the catalog that last wrote the
/// ledger serves a downstream with.
fn adapter_key(downstream: &str) -> String {
    format!("downstream_adapter:{downstream}")
}

/// Records each downstream's adapter (only what changed: concurrent opens of
/// one catalog write nothing), so a read knows the ledger's own catalog.
fn record_downstream_adapters(tx: &Tx<'_>, adapters: &BTreeMap<String, String>) -> Result<(), StoreError> {
    for (name, adapter) in adapters {
        let key = adapter_key(name);
        if tx.meta(&key)?.as_deref() != Some(adapter.as_str()) {
            tx.meta_set(&key, adapter)?;
        }
    }
    Ok(())
}

/// The downstreams this read's catalog serves with another adapter than the
/// ledger's last writer did, with why they are not opened. A ledger that
/// records none (older than this build, or not a ledger: refused later) has none.
fn foreign_downstreams(store: &mut Store, adapters: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let recorded = store.read(|tx| -> Result<Vec<(String, Option<String>)>, StoreError> {
        adapters.keys().map(|name| Ok((name.clone(), tx.meta(&adapter_key(name))?))).collect()
    });
    let mut out = BTreeMap::new();
    for (name, ledger_adapter) in recorded.unwrap_or_default() {
        match (ledger_adapter, adapters.get(&name)) {
            (Some(theirs), Some(ours)) if theirs != *ours => {
                out.insert(
                    name.clone(),
                    format!(
                        "the ledger's catalog serves downstream {name} with adapter `{theirs}`, this read's catalog \
                         with `{ours}` (a read without --catalog uses the built-in demo catalog); pass the ledger's catalog (--catalog DIR)"
                    ),
                );
            }
            _ => {}
        }
    }
    out
}

/// Builds an envelope for a code, with no operation.
/// Each tool's meta key `contract:NAME:I.O.E`, its
/// [`contracts::Contract::semantic_sha256`] and its name.
fn contract_revision_entries(contracts: &Contracts) -> Vec<(String, String, String)> {
    contracts
        .all()
        .iter()
        .map(|c| {
            let r = c.revisions;
            (
                format!("contract:{}:{}.{}.{}", c.name, r.input, r.output, r.effect),
                c.semantic_sha256.clone(),
                c.name.clone(),
            )
        })
        .collect()
}

/// One meaning per (tool, revisions) on a ledger: the first process that
/// opens it for writing with a catalog records each tool's semantic digest
/// under its revisions; a catalog whose tool says something else under the
/// same revisions (another approval policy, schema or effect) is refused at
/// open, so two replicas can never disagree about what an operation accepted
/// under those revisions means. Read-only opens (which accept nothing) are
/// not checked. Runs in the open's own write transaction.
fn check_contract_revisions(tx: &Tx<'_>, entries: &[(String, String, String)]) -> Result<(), EngineError> {
    for (key, digest, name) in entries {
        if tx.meta_init(key, digest)? != *digest {
            return Err(EngineError::invalid(
                "CATALOG_REVISION_REUSED",
                format!(
                    "tool {name}: this catalog changes its effect, approval policy, schemas, result echoes or key \
                     de-duplication under revisions this ledger recorded with another meaning; bump the tool's revisions"
                ),
            ));
        }
    }
    Ok(())
}

/// The envelope of a refused or failed call: `code`'s catalog entry decides
/// its status and outcome; `audit` says what the ledger recorded.
pub fn error_envelope(code: Code, audit: ProtectedAudit) -> Envelope {
    let (_, outcome, _) = code.catalog();
    Envelope {
        model_result: ModelResult {
            status: if outcome == Outcome::Unknown { Status::Unknown } else { Status::Failed },
            data: None,
            error: Some(ErrorInfo::new(code)),
            execution: Execution { outcome, delivery: Delivery::Fresh },
        },
        protected_audit: audit,
    }
}

/// Adds a detail object to an envelope's error.
pub(crate) fn with_detail(mut env: Envelope, detail: Value) -> Envelope {
    if let Some(e) = env.model_result.error.as_mut() {
        e.detail = Some(detail);
    }
    env
}

/// Adds retry_after_ms to an envelope's error.
pub fn with_retry_after(mut env: Envelope, ms: u64) -> Envelope {
    if let Some(e) = env.model_result.error.as_mut() {
        e.retry_after_ms = Some(ms);
    }
    env
}

/// The call identity used when a caller gives none: a fresh one, as a model's
/// retry would carry.
pub fn fresh_call_identity() -> CallIdentity {
    CallIdentity {
        provider: "cli".to_string(),
        api_family: "toolgate".to_string(),
        response_id: ids::Ids::unseeded_id("resp"),
        call_id: ids::Ids::unseeded_id("call"),
        adapter_revision: "1".to_string(),
    }
}
