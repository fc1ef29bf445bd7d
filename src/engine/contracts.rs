//! Tool contracts as data (`assets/contracts/*.json`), with their JSON Schemas
//! compiled once at start-up (never per call).

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

/// Which simulated downstream serves the tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DownstreamKind {
    /// The engine's own order table (reads).
    Orders,
    /// Payments: honours idempotency keys.
    Payments,
    /// Notifications: does not de-duplicate.
    Notifications,
}

impl DownstreamKind {
    /// Stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            DownstreamKind::Orders => "orders",
            DownstreamKind::Payments => "payments",
            DownstreamKind::Notifications => "notifications",
        }
    }

    /// Whether the downstream honours idempotency keys (same key → same effect).
    pub fn honours_keys(self) -> bool {
        matches!(self, DownstreamKind::Payments | DownstreamKind::Orders)
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
    downstream: DownstreamKind,
    data_classification: String,
    approval: ApprovalSpec,
    retry: RetryPolicy,
    #[serde(default)]
    circuit: CircuitPolicy,
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
    /// Downstream.
    pub downstream: DownstreamKind,
    /// Data classification of the arguments (traces show it beside the digest).
    pub data_classification: String,
    /// Approval policy.
    pub approval: ApprovalPolicy,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Circuit breaker thresholds for the tool's downstream.
    pub circuit: CircuitPolicy,
    /// Ledger retention; never shorter than the downstream's de-duplication window.
    pub retention_ms: u64,
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

/// Why the contract catalog did not load.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// The file is not a valid contract.
    #[error("contract {file}: {reason}")]
    Invalid {
        /// File name.
        file: String,
        /// Reason.
        reason: String,
    },
}

const BUILTIN: [(&str, &str); 3] = [
    ("get_order.json", include_str!("../../assets/contracts/get_order.json")),
    ("create_refund.json", include_str!("../../assets/contracts/create_refund.json")),
    ("notify_customer.json", include_str!("../../assets/contracts/notify_customer.json")),
];

/// The tool catalog.
#[derive(Debug)]
pub struct Contracts {
    tools: Vec<Contract>,
}

impl Contracts {
    /// The contracts shipped in `assets/contracts/`.
    pub fn builtin() -> Result<Self, ContractError> {
        Self::from_texts(BUILTIN.iter().map(|(f, t)| (*f, *t)))
    }

    /// Loads contracts from (file name, JSON text) pairs.
    pub fn from_texts<'a>(texts: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, ContractError> {
        let mut tools = Vec::new();
        for (file, text) in texts {
            let invalid = |reason: String| ContractError::Invalid { file: file.to_string(), reason };
            let c: ContractFile = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
            let input =
                jsonschema::validator_for(&c.input_schema).map_err(|e| invalid(format!("input_schema: {e}")))?;
            let output =
                jsonschema::validator_for(&c.output_schema).map_err(|e| invalid(format!("output_schema: {e}")))?;
            tools.push(Contract {
                name: c.name,
                description: c.description,
                revisions: c.revisions,
                effect: c.effect,
                risk: c.risk,
                downstream: c.downstream,
                data_classification: c.data_classification,
                approval: c.approval.policy,
                retry: c.retry,
                circuit: c.circuit,
                retention_ms: c.retention_ms,
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
