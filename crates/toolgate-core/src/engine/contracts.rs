//! The tool catalog: one JSON file per tool (the demo's in `assets/catalog/`),
//! loaded strictly, with its JSON Schemas compiled once at start-up (never per call).

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use super::canonical::Revisions;

/// What a tool does to the world (docs/design.md §1, the effect class decides what a retry costs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// No side effect; retries cost nothing.
    Read,
    /// A side effect the downstream de-duplicates by key.
    Write,
    /// A side effect nobody downstream de-duplicates (email, payment rails).
    External,
}

impl Effect {
    /// Stable string.
    pub fn as_str(self) -> &'static str {
        match self {
            Effect::Read => "read",
            Effect::Write => "write",
            Effect::External => "external",
        }
    }
}

/// When a new execution needs a human approval (docs/design.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalPolicy {
    /// Never.
    Never,
    /// When `amount_minor` exceeds the tenant's threshold.
    AboveThreshold,
    /// Always.
    Always,
}

/// The `downstream` section of a catalog entry: which system executes the
/// tool and what it promises about keys. The adapter named here checks its own
/// settings when the toolset is built.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DownstreamRef {
    /// Name: the circuit breaker is per name, and tools naming one downstream share it.
    pub name: String,
    /// The adapter that reaches it: `local` (answered by the tool's domain),
    /// `simulated` (the demo providers), `http` or `mcp`.
    pub adapter: String,
    /// Whether the downstream de-duplicates by key (same key → the same effect).
    /// A `write` tool needs it, an `external` tool must not claim it.
    #[serde(default)]
    pub dedupes_keys: bool,
    /// The HTTP adapter's settings (only with `adapter: http`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<Value>,
    /// The MCP adapter's settings (only with `adapter: mcp`): the MCP server
    /// that runs the tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<Value>,
    /// How long after a commit its receipt may take to become visible to a
    /// lookup (replication lag, a provider's queue). Default
    /// [`DEFAULT_RECEIPT_VISIBLE_WITHIN_MS`]; at most
    /// [`MAX_RECEIPT_VISIBLE_WITHIN_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_visible_within_ms: Option<u64>,
    /// At most this many calls to this downstream in flight at once from one
    /// process (a bulkhead): beyond it a call is not sent and is answered
    /// `TOOL_UNAVAILABLE` with a retry hint, its operation waiting in the
    /// outbox, so a slow downstream cannot take every engine thread. Default:
    /// the process's (`serve` with 3 or more threads: one less than its
    /// threads; otherwise none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_in_flight: Option<u32>,
    /// How an unknown outcome is asked of a downstream with no lookup by key:
    /// `{"by": "resend", "key_retention_ms": N}` re-sends the very same request
    /// under the same key, which a downstream that de-duplicates keys answers
    /// with the original result (only with `dedupes_keys`; never past the
    /// time it remembers keys). Leave it out for a lookup by key (`http.lookup`)
    /// or none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup: Option<LookupStrategy>,
    /// Whether a worker settles this tool's unknown outcomes itself, with the
    /// status query a person would run, once the receipt window has passed.
    /// Default: yes for `lookup.by = resend`, no otherwise (the unknown queue
    /// waits for a person's `q`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_query: Option<bool>,
}

/// `downstream.lookup`: asking by re-sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LookupStrategy {
    /// `resend`: the status query re-sends the request under its key.
    pub by: LookupBy,
    /// How long the downstream remembers a key (Stripe: 24 hours). A re-send
    /// after it could act a second time, so past it the operation goes to
    /// human review instead. At least the receipt window (attempt timeout plus
    /// `receipt_visible_within_ms`).
    #[schemars(range(min = 1))]
    pub key_retention_ms: u64,
}

/// How a downstream without a lookup by key is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LookupBy {
    /// The same request, under the same key.
    Resend,
}

/// The default of `downstream.receipt_visible_within_ms`: a minute, longer
/// than the replication lag of the providers we know of.
pub const DEFAULT_RECEIPT_VISIBLE_WITHIN_MS: u64 = 60_000;
/// The largest `downstream.receipt_visible_within_ms` accepted (a day).
pub const MAX_RECEIPT_VISIBLE_WITHIN_MS: u64 = 86_400_000;

impl DownstreamRef {
    /// The downstream's name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// Whether the downstream honours idempotency keys (same key → same effect).
    pub fn honours_keys(&self) -> bool {
        self.dedupes_keys
    }

    /// How long a committed call's receipt may take to show in a lookup.
    pub fn receipt_visible_within_ms(&self) -> u64 {
        self.receipt_visible_within_ms.unwrap_or(DEFAULT_RECEIPT_VISIBLE_WITHIN_MS)
    }

    /// Whether what happened under a key can be asked of the downstream: by
    /// key, or by re-sending ([`DownstreamRef::resend_retention_ms`]). An http
    /// downstream says `"lookup": null` when its service has no lookup by key;
    /// without a re-send an unknown outcome then goes straight to human review.
    pub fn can_look_up(&self) -> bool {
        self.lookup.is_some() || self.looks_up_by_key()
    }

    /// Whether the downstream can be asked by key without acting (a lookup
    /// that reads): what a person's evidence, the audit and the retention
    /// re-check may use. A re-send is not one of those.
    pub fn looks_up_by_key(&self) -> bool {
        self.lookup.is_none()
            && match self.adapter.as_str() {
                "http" => !self.http.as_ref().and_then(|h| h.get("lookup")).is_some_and(Value::is_null),
                // MCP has no "what happened under this key": only a re-send asks.
                "mcp" => false,
                _ => true,
            }
    }

    /// How long the downstream remembers a key, when a status query re-sends
    /// the request (`lookup.by = resend`).
    pub fn resend_retention_ms(&self) -> Option<u64> {
        self.lookup.map(|l| match l.by {
            LookupBy::Resend => l.key_retention_ms,
        })
    }

    /// Whether a worker settles unknown outcomes of this downstream itself.
    pub fn auto_query(&self) -> bool {
        self.can_look_up() && self.auto_query.unwrap_or(self.lookup.is_some())
    }

    /// Where an operation whose outcome cannot be known waits: the unknown
    /// queue (a status query settles it), or human review when the
    /// downstream cannot be asked.
    pub fn unknown_state(&self) -> crate::store::OpState {
        if self.can_look_up() {
            crate::store::OpState::Unknown
        } else {
            crate::store::OpState::NeedsReview
        }
    }
}

/// Retry policy of a tool (docs/design.md §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// One attempt may take this long (also the lease length).
    pub attempt_timeout_ms: u64,
    /// Default operation deadline.
    pub deadline_ms: u64,
    /// Backoff base.
    pub backoff_base_ms: u64,
    /// Backoff cap.
    pub backoff_cap_ms: u64,
    /// Attempt cap.
    pub max_attempts: u32,
    /// Retry budget: automatic retries may add at most this percentage of the
    /// tool's first-attempt load (each first attempt deposits `percent / 100` of a
    /// token, each retry spends one).
    #[serde(default = "default_budget_percent")]
    pub budget_percent: u32,
    /// Retry budget: the bucket's capacity in whole retries (the burst allowed
    /// before the ratio bites).
    #[serde(default = "default_budget_burst")]
    pub budget_burst: u32,
}

fn default_budget_percent() -> u32 {
    20
}

fn default_budget_burst() -> u32 {
    10
}

/// The circuit breaker of the tool's downstream (docs/design.md §11). The breaker's state is
/// per downstream; the thresholds come from the contract of the tool calling it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CircuitPolicy {
    /// Consecutive transient failures (unavailable, connect timeout, response
    /// timeout, malformed reply) that open the circuit. Keep it above the tool's
    /// `max_attempts`: one unlucky operation's own retries should not open the
    /// circuit for every caller.
    pub failure_threshold: u32,
    /// How long an open circuit refuses calls before it lets one probe through.
    pub cool_down_ms: u64,
}

impl Default for CircuitPolicy {
    fn default() -> Self {
        Self { failure_threshold: 10, cool_down_ms: 5_000 }
    }
}

/// A tool's `approval` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ApprovalSpec {
    /// When a new execution needs a human approval.
    policy: ApprovalPolicy,
}

/// One catalog file: one tool (docs/catalog.md documents every field).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ContractFile {
    name: String,
    description: String,
    revisions: Revisions,
    effect: Effect,
    risk: String,
    downstream: DownstreamRef,
    data_classification: String,
    approval: ApprovalSpec,
    retry: RetryPolicy,
    #[serde(default)]
    circuit: CircuitPolicy,
    #[serde(default)]
    result_echoes: Vec<String>,
    retention_ms: u64,
    input_schema: Value,
    output_schema: Value,
}

/// The JSON Schema of a catalog file, derived from the structs the loader
/// reads it into (so the two cannot disagree). `downstream.http` is the
/// `http` adapter's own section, checked by the adapter
/// (`crate::downstream::http::http_section_schema`).
pub fn catalog_file_schema() -> Value {
    serde_json::to_value(schemars::schema_for!(ContractFile)).unwrap_or(Value::Null)
}

/// One tool contract, schemas compiled.
pub struct Contract {
    /// Tool name.
    pub name: String,
    /// Human description.
    pub description: String,
    /// Contract revisions.
    pub revisions: Revisions,
    /// Effect class.
    pub effect: Effect,
    /// Risk label (metrics slice).
    pub risk: String,
    /// The catalog file it came from (file name only: errors name it).
    pub file: String,
    /// Downstream.
    pub downstream: DownstreamRef,
    /// Data classification of the arguments (traces show it beside the digest).
    pub data_classification: String,
    /// Approval policy.
    pub approval: ApprovalPolicy,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Circuit breaker thresholds for the tool's downstream.
    pub circuit: CircuitPolicy,
    /// Arguments a receipt's result must restate (a receipt found by a status
    /// query is accepted only if each of these equals the argument sent).
    pub result_echoes: Vec<String>,
    /// Ledger retention; never shorter than the downstream's de-duplication window.
    pub retention_ms: u64,
    /// The input schema as written (the MCP server lists it).
    pub input_schema: Value,
    /// The output schema as written (the MCP server lists it inside its
    /// result's schema).
    pub output_schema: Value,
    /// SHA-256 of what an operation accepted under these revisions depends on
    /// (effect, approval policy, schemas, result echoes, key de-duplication),
    /// in RFC 8785 form: a ledger records it per (tool, revisions) and refuses
    /// a catalog that changed them without a revision bump.
    pub semantic_sha256: String,
    input: jsonschema::Validator,
    output: jsonschema::Validator,
}

impl std::fmt::Debug for Contract {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contract").field("name", &self.name).field("revisions", &self.revisions).finish_non_exhaustive()
    }
}

/// A schema violation, located by JSON pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaViolation {
    /// JSON pointer into the instance (`""` is the root).
    pub pointer: String,
    /// What is wrong (names no values from the instance).
    pub reason: String,
}

impl Contract {
    /// Validates arguments against the input schema.
    pub fn check_input(&self, args: &Value) -> Result<(), SchemaViolation> {
        check(&self.input, args)
    }

    /// Validates a downstream result against the output schema.
    pub fn check_output(&self, result: &Value) -> Result<(), SchemaViolation> {
        check(&self.output, result)
    }

    /// Whether a result restates every argument of `result_echoes` as sent.
    pub fn echoes(&self, args: &Value, result: &Value) -> bool {
        self.result_echoes.iter().all(|k| args.get(k).is_none() || result.get(k) == args.get(k))
    }
}

fn check(v: &jsonschema::Validator, instance: &Value) -> Result<(), SchemaViolation> {
    match v.iter_errors(instance).next() {
        None => Ok(()),
        Some(e) => Err(SchemaViolation { pointer: e.instance_path().to_string(), reason: violation_kind(&e) }),
    }
}

/// A reason that names the rule, not the offending value (which may be sensitive).
fn violation_kind(e: &jsonschema::ValidationError<'_>) -> String {
    let path = e.schema_path().to_string();
    let keyword = path.rsplit('/').find(|s| !s.is_empty() && s.parse::<usize>().is_err()).unwrap_or("schema");
    match keyword {
        "additionalProperties" => "unexpected property".to_string(),
        "required" => "missing required property".to_string(),
        "type" => "wrong type".to_string(),
        "enum" | "const" => "value not allowed".to_string(),
        "pattern" => "does not match the required format".to_string(),
        "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => "out of range".to_string(),
        other => format!("violates `{other}`"),
    }
}

/// Why the tool catalog did not load (`CATALOG_INVALID`).
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// A file is not a valid catalog entry.
    #[error("catalog file {file}{}: {reason}", if field.is_empty() { String::new() } else { format!(", field {field}") })]
    Invalid {
        /// File name (never a local path).
        file: String,
        /// Where in the file (`downstream.adapter`), empty for the whole file.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The catalog directory cannot be read.
    #[error("catalog directory: {0}")]
    Unreadable(String),
    /// Several problems (each an `Invalid`), all reported at once, one a line.
    #[error("{} problems:\n{}", .0.len(), .0.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Several(Vec<ContractError>),
}

impl ContractError {
    /// `Ok` for no problem, the problem itself for one, [`ContractError::Several`] for more.
    pub fn all(mut problems: Vec<ContractError>) -> Result<(), ContractError> {
        match problems.len() {
            0 => Ok(()),
            1 => Err(problems.remove(0)),
            _ => Err(ContractError::Several(problems)),
        }
    }

    /// Each problem, owned (one, or each of [`ContractError::Several`]).
    pub fn into_problems(self) -> Vec<ContractError> {
        match self {
            ContractError::Several(list) => list,
            one => vec![one],
        }
    }

    /// Each problem (one, or each of [`ContractError::Several`]).
    pub fn problems(&self) -> Vec<&ContractError> {
        match self {
            ContractError::Several(list) => list.iter().collect(),
            one => vec![one],
        }
    }
}

/// The longest catalog file accepted.
pub const MAX_CATALOG_FILE_BYTES: u64 = 1 << 20;

/// The tool catalog.
#[derive(Debug)]
pub struct Contracts {
    tools: Vec<Contract>,
}

fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && s.as_bytes()[0].is_ascii_lowercase()
}

impl Contracts {
    /// Loads every `*.json` file of a directory (other files, such as a README,
    /// are ignored), in name order. Strict: unknown fields, bad schemas, duplicate
    /// names and an effect class that does not fit the downstream are refused.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self, ContractError> {
        let (sound, problems) = Self::from_dir_partial(dir)?;
        ContractError::all(problems)?;
        Ok(sound)
    }

    /// [`Contracts::from_dir`], keeping what loaded beside every problem of
    /// the rest (so a caller can check the sound tools further and report
    /// everything in one run); `Err` only when the directory cannot be read.
    pub fn from_dir_partial(dir: &std::path::Path) -> Result<(Self, Vec<ContractError>), ContractError> {
        let entries = std::fs::read_dir(dir).map_err(|e| ContractError::Unreadable(e.kind().to_string()))?;
        let mut files = Vec::new();
        for e in entries {
            let e = e.map_err(|e| ContractError::Unreadable(e.kind().to_string()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if std::path::Path::new(&name).extension().is_some_and(|x| x == "json") {
                files.push((name, e.path()));
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(ContractError::Unreadable("no *.json tool files in it".into()));
        }
        let mut texts = Vec::new();
        let mut problems = Vec::new();
        for (name, path) in files {
            let invalid = |reason: String| ContractError::Invalid { file: name.clone(), field: String::new(), reason };
            let text = match std::fs::metadata(&path) {
                Err(e) => Err(invalid(e.kind().to_string())),
                Ok(m) if m.len() > MAX_CATALOG_FILE_BYTES => {
                    Err(invalid(format!("larger than {MAX_CATALOG_FILE_BYTES} bytes")))
                }
                Ok(_) => std::fs::read_to_string(&path).map_err(|e| invalid(e.kind().to_string())),
            };
            match text {
                Ok(t) => texts.push((name, t)),
                Err(p) => problems.push(p),
            }
        }
        let (sound, mut more) = Self::from_texts_partial(texts.iter().map(|(f, t)| (f.as_str(), t.as_str())));
        problems.append(&mut more);
        Ok((sound, problems))
    }

    /// Loads contracts from (file name, JSON text) pairs. Every problem of
    /// every file is reported at once (a file's shape first: each missing,
    /// unknown or mistyped field against [`catalog_file_schema`]; then its
    /// rules), each naming its file and field path.
    pub fn from_texts<'a>(texts: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, ContractError> {
        let (sound, problems) = Self::from_texts_partial(texts);
        ContractError::all(problems)?;
        Ok(sound)
    }

    /// [`Contracts::from_texts`], keeping the tools that loaded beside the
    /// problems of the others.
    pub fn from_texts_partial<'a>(texts: impl IntoIterator<Item = (&'a str, &'a str)>) -> (Self, Vec<ContractError>) {
        let mut tools: Vec<Contract> = Vec::new();
        let mut problems = Vec::new();
        for (file, text) in texts {
            match load_one(file, text, &tools) {
                Ok(c) => tools.push(c),
                Err(mut p) => problems.append(&mut p),
            }
        }
        (Self { tools }, problems)
    }

    /// A tool by name.
    pub fn get(&self, name: &str) -> Option<&Contract> {
        self.tools.iter().find(|c| c.name == name)
    }

    /// All tools.
    pub fn all(&self) -> &[Contract] {
        &self.tools
    }

    /// Replaces one tool's revisions (tests and the lab use this to simulate a
    /// contract change between accept and execution).
    pub fn set_revisions(&mut self, name: &str, rev: Revisions) {
        if let Some(c) = self.tools.iter_mut().find(|c| c.name == name) {
            c.revisions = rev;
        }
    }
}

/// The compiled [`catalog_file_schema`], built once.
fn catalog_validator() -> Option<&'static jsonschema::Validator> {
    static V: std::sync::OnceLock<Option<jsonschema::Validator>> = std::sync::OnceLock::new();
    // Derived from this crate's own types, it compiles; were it ever not to,
    // the typed read below still refuses (one problem at a time), no panic.
    V.get_or_init(|| jsonschema::validator_for(&catalog_file_schema()).ok()).as_ref()
}

/// Every way a JSON value breaks a schema, as (field path, reason): a missing
/// field and an unknown one are named themselves, an enumeration says its
/// allowed values. `prefix` is where `value` sits in its file.
pub fn shape_problems(
    validator: &jsonschema::Validator,
    schema: &Value,
    value: &Value,
    prefix: &str,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in validator.iter_errors(value) {
        let at = join_path(prefix, &field_path(&e.instance_path().to_string()));
        match e.kind() {
            jsonschema::error::ValidationErrorKind::Required { property } => {
                let name = property.as_str().unwrap_or_default();
                out.push((join_path(&at, name), "missing (required)".to_string()));
            }
            jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected } => {
                let allowed = subschema_at(schema, &field_path(&e.instance_path().to_string()))
                    .and_then(|s| s.get("properties"))
                    .and_then(Value::as_object)
                    .map(|p| p.keys().map(String::as_str).collect::<Vec<_>>().join(", "))
                    .unwrap_or_default();
                for u in unexpected {
                    out.push((join_path(&at, u), format!("unknown field (allowed here: {allowed})")));
                }
            }
            _ => {
                let consts: Vec<String> = subschema_at(schema, &field_path(&e.instance_path().to_string()))
                    .and_then(|s| s.get("oneOf"))
                    .and_then(Value::as_array)
                    .map(|alts| alts.iter().filter_map(|a| a.get("const")).map(Value::to_string).collect())
                    .unwrap_or_default();
                let reason =
                    if consts.is_empty() { e.to_string() } else { format!("must be one of {}", consts.join(", ")) };
                out.push((at, reason));
            }
        }
    }
    out
}

/// A JSON pointer (`/downstream/http/0`) as a field path (`downstream.http[0]`).
fn field_path(pointer: &str) -> String {
    let mut out = String::new();
    for seg in pointer.split('/').skip(1) {
        let seg = seg.replace("~1", "/").replace("~0", "~");
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push('[');
            out.push_str(&seg);
            out.push(']');
        } else {
            out = join_path(&out, &seg);
        }
    }
    out
}

fn join_path(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (true, _) => field.to_string(),
        (_, true) => prefix.to_string(),
        _ if field.starts_with('[') => format!("{prefix}{field}"),
        _ => format!("{prefix}.{field}"),
    }
}

/// A subschema of the derived catalog schema `root` as it is meant: a
/// `$ref` into `$defs` followed, an `Option<T>` (anyOf T and null in some
/// schemars versions) taken as T.
pub fn resolve_subschema<'s>(root: &'s Value, mut s: &'s Value) -> Option<&'s Value> {
    for _ in 0..8 {
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            s = root.pointer(r.strip_prefix('#')?)?;
        } else if let Some(alt) = s
            .get("anyOf")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find(|x| x.get("type").and_then(Value::as_str) != Some("null")))
        {
            s = alt;
        } else {
            break;
        }
    }
    Some(s)
}

/// The subschema of `schema` (a schemars schema: local `$ref`s into `$defs`)
/// that describes the value at a field path (`downstream.http`, `x[0]`).
pub fn subschema_at<'s>(schema: &'s Value, path: &str) -> Option<&'s Value> {
    let resolve = |s: &'s Value| resolve_subschema(schema, s);
    let mut cur = resolve(schema)?;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (name, indexed) = match part.find('[') {
            Some(i) => (&part[..i], true),
            None => (part, false),
        };
        if !name.is_empty() {
            cur = resolve(cur.get("properties")?.get(name)?)?;
        }
        if indexed {
            cur = resolve(cur.get("items")?)?;
        }
    }
    Some(cur)
}

/// One catalog file: its shape, then its rules, every problem at once.
/// `earlier`: the tools of the files before it that loaded.
fn load_one(file: &str, text: &str, earlier: &[Contract]) -> Result<Contract, Vec<ContractError>> {
    let invalid = |field: &str, reason: String| ContractError::Invalid {
        file: file.to_string(),
        field: field.to_string(),
        reason,
    };
    let value: Value = serde_json::from_str(text).map_err(|e| vec![invalid("", e.to_string())])?;
    let shape = catalog_validator().map(|v| shape_problems(v, &catalog_file_schema(), &value, "")).unwrap_or_default();
    if !shape.is_empty() {
        return Err(shape.into_iter().map(|(f, r)| invalid(&f, r)).collect());
    }
    // The shape fits, so what is left for serde is what JSON Schema cannot
    // say (a key given twice).
    let mut de = serde_json::Deserializer::from_str(text);
    let c: ContractFile = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        vec![invalid(&field, e.into_inner().to_string())]
    })?;
    let mut problems = Vec::new();
    let mut fail = |field: &str, reason: String| problems.push(invalid(field, reason));
    if !valid_name(&c.name) {
        fail("name", "must be 1..64 of a-z, 0-9 and _, starting with a letter".into());
    }
    if earlier.iter().any(|t| t.name == c.name) {
        fail("name", format!("duplicate tool name {}", c.name));
    }
    if !valid_name(&c.downstream.name) {
        fail("downstream.name", "must be 1..64 of a-z, 0-9 and _, starting with a letter".into());
    }
    if let Some(other) = earlier.iter().find(|t| t.downstream.name == c.downstream.name) {
        if other.downstream != c.downstream {
            fail("downstream", format!("downstream {} is configured differently in {}", c.downstream.name, other.file));
        }
    }
    match (c.effect, c.downstream.dedupes_keys) {
        (Effect::Write, false) => fail(
            "downstream.dedupes_keys",
            "a `write` tool needs a downstream that de-duplicates by key (or declare it `external`)".into(),
        ),
        (Effect::External, true) => fail(
            "downstream.dedupes_keys",
            "an `external` tool's downstream does not de-duplicate by key (or declare it `write`)".into(),
        ),
        _ => {}
    }
    if [c.revisions.input, c.revisions.output, c.revisions.effect].iter().any(|r| *r < 1) {
        fail("revisions", "every revision is a positive integer".into());
    }
    if c.retry.max_attempts == 0 || c.retry.attempt_timeout_ms == 0 || c.retry.deadline_ms == 0 {
        fail("retry", "max_attempts, attempt_timeout_ms and deadline_ms must be positive".into());
    }
    if c.downstream.max_in_flight == Some(0) {
        fail("downstream.max_in_flight", "at least 1 (leave it out for the process's default)".to_string());
    }
    if c.downstream.receipt_visible_within_ms.is_some_and(|ms| ms > MAX_RECEIPT_VISIBLE_WITHIN_MS) {
        fail("downstream.receipt_visible_within_ms", format!("at most {MAX_RECEIPT_VISIBLE_WITHIN_MS} (a day)"));
    }
    if let Some(l) = c.downstream.lookup {
        if !c.downstream.dedupes_keys {
            fail(
                "downstream.lookup",
                "a re-send asks nothing of a downstream that does not de-duplicate keys: it acts again (dedupes_keys must be true)".into(),
            );
        }
        let window = c.retry.attempt_timeout_ms.saturating_add(c.downstream.receipt_visible_within_ms());
        if l.key_retention_ms <= window {
            fail(
                "downstream.lookup.key_retention_ms",
                format!("must be longer than the receipt window ({window} ms: attempt_timeout_ms + receipt_visible_within_ms), or no re-send could ever be made"),
            );
        }
    }
    if c.downstream.auto_query == Some(true) && !c.downstream.can_look_up() {
        fail("downstream.auto_query", "this downstream cannot be asked (no lookup by key and no re-send)".into());
    }
    if c.effect != Effect::Read && c.retention_ms == 0 {
        fail("retention_ms", "a tool with an effect keeps its ledger rows (> 0)".into());
    }
    let props = c.input_schema.get("properties");
    for (i, k) in c.result_echoes.iter().enumerate() {
        if props.and_then(|p| p.get(k)).is_none() {
            fail(&format!("result_echoes[{i}]"), format!("{k:?} is not an input property"));
        }
    }
    // Over MCP a tool with an effect takes its key as the argument
    // `idempotency_key` (MCP has no header): a tool argument of that
    // name would be taken away from the tool.
    if c.effect != Effect::Read && props.is_some_and(|p| p.get("idempotency_key").is_some()) {
        fail(
            "input_schema.properties.idempotency_key",
            "the name is toolgate's: over MCP it carries the call's idempotency key; rename the argument".into(),
        );
    }
    if c.approval.policy == ApprovalPolicy::AboveThreshold {
        // The amount at stake is the integer argument `amount_minor`
        // (minor currency units), compared with the tenant's threshold.
        let ty = props.and_then(|p| p.get("amount_minor")).and_then(|a| a.get("type"));
        if ty != Some(&Value::String("integer".into())) {
            fail("approval.policy", "above_threshold needs an integer input property amount_minor".into());
        }
    }
    let input = jsonschema::validator_for(&c.input_schema).map_err(|e| fail("input_schema", e.to_string())).ok();
    let output = jsonschema::validator_for(&c.output_schema).map_err(|e| fail("output_schema", e.to_string())).ok();
    let (Some(input), Some(output)) = (input, output) else { return Err(problems) };
    if !problems.is_empty() {
        return Err(problems);
    }
    let semantic = serde_json::json!({
        "name": c.name, "effect": c.effect, "approval": format!("{:?}", c.approval.policy),
        "input_schema": c.input_schema, "output_schema": c.output_schema,
        "result_echoes": c.result_echoes, "dedupes_keys": c.downstream.dedupes_keys,
    });
    let semantic_sha256 = super::canonical::sha256_hex(super::canonical::canonical_string(&semantic).as_bytes());
    Ok(Contract {
        name: c.name,
        description: c.description,
        revisions: c.revisions,
        effect: c.effect,
        risk: c.risk,
        file: file.to_string(),
        downstream: c.downstream,
        data_classification: c.data_classification,
        approval: c.approval.policy,
        retry: c.retry,
        circuit: c.circuit,
        result_echoes: c.result_echoes,
        retention_ms: c.retention_ms,
        input_schema: c.input_schema,
        output_schema: c.output_schema,
        semantic_sha256,
        input,
        output,
    })
}
