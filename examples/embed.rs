//! Embedding toolgate in a Rust harness with your own tool and your own
//! downstream: `cargo run --example embed`.
//!
//! The tool is `send_invoice`, executed by an invoicing API that this example
//! stands in for with an in-memory [`Downstream`] that de-duplicates by key
//! (as Stripe-like APIs do) and can lose a reply. The harness dispatches,
//! loses the reply, retries with the same idempotency key (which never
//! re-sends: the outcome is unknown), then asks with an explicit status query,
//! which finds the one invoice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use toolgate::engine::contracts::{Contract, Contracts, DownstreamRef, Effect};
use toolgate::engine::tool::{
    Downstream, DownstreamContext, DownstreamError, DownstreamFactory, DownstreamRequest, Lookup, Receipt, Reply,
    Toolset,
};
use toolgate::engine::world::World;
use toolgate::engine::{DispatchRequest, Engine, EngineOptions, QueryRequest};

/// The tool's catalog entry: the same JSON a `--catalog DIR` file holds.
const SEND_INVOICE: &str = r#"{
  "name": "send_invoice",
  "description": "Issue an invoice to a customer through the invoicing API.",
  "revisions": {"input": 1, "output": 1, "effect": 1},
  "effect": "write",
  "risk": "medium",
  "downstream": {"name": "invoicing", "adapter": "invoicing_api", "dedupes_keys": true},
  "data_classification": "financial",
  "approval": {"policy": "never"},
  "retry": {"attempt_timeout_ms": 2000, "deadline_ms": 10000, "backoff_base_ms": 50, "backoff_cap_ms": 500, "max_attempts": 3},
  "result_echoes": ["customer", "amount_minor"],
  "retention_ms": 2592000000,
  "input_schema": {
    "type": "object", "additionalProperties": false, "required": ["customer", "amount_minor"],
    "properties": {"customer": {"type": "string", "minLength": 1}, "amount_minor": {"type": "integer", "minimum": 1}}
  },
  "output_schema": {
    "type": "object", "additionalProperties": false, "required": ["invoice_id", "customer", "amount_minor"],
    "properties": {"invoice_id": {"type": "string"}, "customer": {"type": "string"}, "amount_minor": {"type": "integer"}}
  }
}"#;

const WORLD: &str = r#"{
  "tenants": [{"id": "acme", "approvers": ["ops"], "approval_threshold_minor": 100000}],
  "subjects": [{"id": "billing_agent", "tenant": "acme"}],
  "grants": [{"tenant": "acme", "subject": "billing_agent", "tool": "send_invoice"}]
}"#;

/// The invoicing API's state: invoices by idempotency key.
#[derive(Default)]
struct Api {
    invoices: HashMap<String, Receipt>,
    /// The next reply is lost after the invoice was created.
    lose_next_reply: bool,
}

struct InvoicingApi(Arc<Mutex<Api>>);

impl Downstream for InvoicingApi {
    fn execute(&mut self, key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError> {
        let mut api = self.0.lock().expect("api lock");
        let n = api.invoices.len() + 1;
        let receipt = api
            .invoices
            .entry(key.to_string())
            .or_insert_with(|| Receipt {
                receipt_id: format!("inv_{n:04}"),
                request_id: format!("req_{n:04}"),
                body_sha256: None,
                // The API echoes the key it made the invoice under.
                key: Some(key.to_string()),
                result: json!({
                    "invoice_id": format!("inv_{n:04}"),
                    "customer": req.arguments["customer"],
                    "amount_minor": req.arguments["amount_minor"],
                }),
                headers: Vec::new(),
            })
            .clone();
        if std::mem::take(&mut api.lose_next_reply) {
            // Created, but the reply never arrives: the caller cannot know.
            return Ok(Reply::TimedOut);
        }
        Ok(Reply::Committed(receipt))
    }

    fn lookup(&mut self, key: &str, _timeout_ms: u64) -> Result<Lookup, DownstreamError> {
        let api = self.0.lock().expect("api lock");
        Ok(api.invoices.get(key).cloned().map_or(Lookup::NotFound, Lookup::Found))
    }
}

/// Opens the adapter for each engine (all share the one in-memory API here).
struct InvoicingAdapter(Arc<Mutex<Api>>);

impl DownstreamFactory for InvoicingAdapter {
    fn check(&self, c: &Contract) -> Result<(), (String, String)> {
        if c.downstream.http.is_some() {
            return Err(("http".into(), "this adapter takes no http settings".into()));
        }
        // It creates invoices: a read tool would be answered by creating one.
        if c.effect == Effect::Read {
            return Err(("adapter".into(), "this adapter creates invoices; it answers no read tool".into()));
        }
        Ok(())
    }

    fn open(&self, _d: &DownstreamRef, _ctx: &DownstreamContext<'_>) -> Result<Box<dyn Downstream>, DownstreamError> {
        Ok(Box::new(InvoicingApi(self.0.clone())))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let api = Arc::new(Mutex::new(Api::default()));
    let catalog = Arc::new(Contracts::from_texts([("send_invoice.json", SEND_INVOICE)])?);
    // No domain for this tool: grants authorize it, its schema is its only
    // rule, and the invoicing API's receipt is the result.
    let toolset =
        Toolset::builder(catalog).adapter("invoicing_api", Arc::new(InvoicingAdapter(api.clone()))).build()?;

    let dir = tempfile::tempdir()?;
    let db = dir.path().join("ledger.db");
    let mut engine = Engine::create(&db, EngineOptions::new(Arc::new(toolset)))?;
    engine.load_world(&World::parse(WORLD.as_bytes())?)?;

    let call = DispatchRequest {
        tenant: "acme".into(),
        subject: "billing_agent".into(),
        tool: "send_invoice".into(),
        arguments: br#"{"customer":"cus_42","amount_minor":12500}"#.to_vec(),
        idempotency_key: Some("invoice-cus_42-2026-12".into()),
        ..DispatchRequest::default()
    };

    api.lock().expect("api lock").lose_next_reply = true;
    let first = engine.dispatch(&call)?;
    println!("1. dispatch, reply lost:      {}", summary(first.model_result.status, first.code()));

    // The model retries the same intent with the same key: never re-sent.
    let retry = engine.dispatch(&call)?;
    println!("2. retry with the same key:   {}", summary(retry.model_result.status, retry.code()));

    // The harness asks instead, with the handle the first envelope gave it.
    let query = engine.query_operation_status(&QueryRequest {
        tenant: call.tenant.clone(),
        subject: call.subject.clone(),
        status_ref: first.status_ref().unwrap_or_default().to_string(),
        expected_request_sha256: first.protected_audit.binding.request_sha256.clone().unwrap_or_default(),
        idempotency_key: call.idempotency_key.clone(),
        ..QueryRequest::default()
    })?;
    let data = query.model_result.data.clone().unwrap_or(Value::Null);
    println!("3. explicit status query:     {} {data}", summary(query.model_result.status, query.code()));
    println!("   invoices at the API:       {}", api.lock().expect("api lock").invoices.len());
    Ok(())
}

fn summary(status: toolgate::engine::envelope::Status, code: Option<toolgate::engine::envelope::Code>) -> String {
    match code {
        Some(c) => format!("{status:?} ({})", c.as_str()),
        None => format!("{status:?}"),
    }
}
