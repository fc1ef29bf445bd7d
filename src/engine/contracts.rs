//! The tool catalog: one JSON file per tool (the demo's in `assets/catalog/`),
//! loaded strictly, with its JSON Schemas compiled once at start-up (never per call).

use serde::Deserialize;
use serde_json::Value;

use super::canonical::Revisions;

/// What a tool does to the world (docs/design.md §1, the effect class decides what a retry costs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct DownstreamRef {
    /// Name: the circuit breaker is per name, and tools naming one downstream share it.
    pub name: String,
    /// The adapter that reaches it: `local` (answered by the tool's domain),
    /// `simulated` (the demo providers) or `http`.
    pub adapter: String,
    /// Whether the downstream de-duplicates by key (same key → the same effect).
    /// A `write` tool needs it, an `external` tool must not claim it.
    #[serde(default)]
    pub dedupes_keys: bool,
    /// The HTTP adapter's settings (only with `adapter: http`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<Value>,
    /// How long after a commit its receipt may take to become visible to a
    /// lookup (replication lag, a provider's queue). Default
    /// [`DEFAULT_RECEIPT_VISIBLE_WITHIN_MS`]; at most
    /// [`MAX_RECEIPT_VISIBLE_WITHIN_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_visible_within_ms: Option<u64>,
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

    /// Whether what happened under a key can be asked of the downstream. An
    /// http downstream says `"lookup": null` when its service has no lookup;
    /// then an unknown outcome goes straight to human review.
    pub fn can_look_up(&self) -> bool {
        !(self.adapter == "http" && self.http.as_ref().and_then(|h| h.get("lookup")).is_some_and(Value::is_null))
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalSpec {
    policy: ApprovalPolicy,
}

#[derive(Debug, Deserialize)]
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
        let mut texts = Vec::new();
        for (name, path) in files {
            let invalid = |reason: String| ContractError::Invalid { file: name.clone(), field: String::new(), reason };
            let len = std::fs::metadata(&path).map_err(|e| invalid(e.kind().to_string()))?.len();
            if len > MAX_CATALOG_FILE_BYTES {
                return Err(invalid(format!("larger than {MAX_CATALOG_FILE_BYTES} bytes")));
            }
            let text = std::fs::read_to_string(&path).map_err(|e| invalid(e.kind().to_string()))?;
            texts.push((name, text));
        }
        if texts.is_empty() {
            return Err(ContractError::Unreadable("no *.json tool files in it".into()));
        }
        Self::from_texts(texts.iter().map(|(f, t)| (f.as_str(), t.as_str())))
    }

    /// Loads contracts from (file name, JSON text) pairs.
    pub fn from_texts<'a>(texts: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, ContractError> {
        let mut tools: Vec<Contract> = Vec::new();
        for (file, text) in texts {
            let invalid = |field: &str, reason: String| ContractError::Invalid {
                file: file.to_string(),
                field: field.to_string(),
                reason,
            };
            let mut de = serde_json::Deserializer::from_str(text);
            let c: ContractFile = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let field = e.path().to_string();
                let field = if field == "." { String::new() } else { field };
                invalid(&field, e.into_inner().to_string())
            })?;
            if !valid_name(&c.name) {
                return Err(invalid("name", "must be 1..64 of a-z, 0-9 and _, starting with a letter".into()));
            }
            if tools.iter().any(|t| t.name == c.name) {
                return Err(invalid("name", format!("duplicate tool name {}", c.name)));
            }
            if !valid_name(&c.downstream.name) {
                return Err(invalid(
                    "downstream.name",
                    "must be 1..64 of a-z, 0-9 and _, starting with a letter".into(),
                ));
            }
            if let Some(other) = tools.iter().find(|t| t.downstream.name == c.downstream.name) {
                if other.downstream != c.downstream {
                    return Err(invalid(
                        "downstream",
                        format!("downstream {} is configured differently in {}", c.downstream.name, other.file),
                    ));
                }
            }
            match (c.effect, c.downstream.dedupes_keys) {
                (Effect::Write, false) => {
                    return Err(invalid(
                        "downstream.dedupes_keys",
                        "a `write` tool needs a downstream that de-duplicates by key (or declare it `external`)".into(),
                    ))
                }
                (Effect::External, true) => {
                    return Err(invalid(
                        "downstream.dedupes_keys",
                        "an `external` tool's downstream does not de-duplicate by key (or declare it `write`)".into(),
                    ))
                }
                _ => {}
            }
            if [c.revisions.input, c.revisions.output, c.revisions.effect].iter().any(|r| *r < 1) {
                return Err(invalid("revisions", "every revision is a positive integer".into()));
            }
            if c.retry.max_attempts == 0 || c.retry.attempt_timeout_ms == 0 || c.retry.deadline_ms == 0 {
                return Err(invalid(
                    "retry",
                    "max_attempts, attempt_timeout_ms and deadline_ms must be positive".into(),
                ));
            }
            if c.downstream.receipt_visible_within_ms.is_some_and(|ms| ms > MAX_RECEIPT_VISIBLE_WITHIN_MS) {
                return Err(invalid(
                    "downstream.receipt_visible_within_ms",
                    format!("at most {MAX_RECEIPT_VISIBLE_WITHIN_MS} (a day)"),
                ));
            }
            if c.effect != Effect::Read && c.retention_ms == 0 {
                return Err(invalid("retention_ms", "a tool with an effect keeps its ledger rows (> 0)".into()));
            }
            let props = c.input_schema.get("properties");
            for (i, k) in c.result_echoes.iter().enumerate() {
                if props.and_then(|p| p.get(k)).is_none() {
                    return Err(invalid(&format!("result_echoes[{i}]"), format!("{k:?} is not an input property")));
                }
            }
            // Over MCP a tool with an effect takes its key as the argument
            // `idempotency_key` (MCP has no header): a tool argument of that
            // name would be taken away from the tool.
            if c.effect != Effect::Read && props.is_some_and(|p| p.get("idempotency_key").is_some()) {
                return Err(invalid(
                    "input_schema.properties.idempotency_key",
                    "the name is toolgate's: over MCP it carries the call's idempotency key; rename the argument"
                        .into(),
                ));
            }
            if c.approval.policy == ApprovalPolicy::AboveThreshold {
                // The amount at stake is the integer argument `amount_minor`
                // (minor currency units), compared with the tenant's threshold.
                let ty = props.and_then(|p| p.get("amount_minor")).and_then(|a| a.get("type"));
                if ty != Some(&Value::String("integer".into())) {
                    return Err(invalid(
                        "approval.policy",
                        "above_threshold needs an integer input property amount_minor".into(),
                    ));
                }
            }
            let semantic = serde_json::json!({
                "name": c.name, "effect": c.effect, "approval": format!("{:?}", c.approval.policy),
                "input_schema": c.input_schema, "output_schema": c.output_schema,
                "result_echoes": c.result_echoes, "dedupes_keys": c.downstream.dedupes_keys,
            });
            let semantic_sha256 =
                super::canonical::sha256_hex(super::canonical::canonical_string(&semantic).as_bytes());
            let input =
                jsonschema::validator_for(&c.input_schema).map_err(|e| invalid("input_schema", e.to_string()))?;
            let output =
                jsonschema::validator_for(&c.output_schema).map_err(|e| invalid("output_schema", e.to_string()))?;
            tools.push(Contract {
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
            });
        }
        Ok(Self { tools })
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
