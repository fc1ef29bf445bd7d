//! Downstream providers: the adapter trait and the simulated, durable payments and
//! notifications providers with their fault plans (docs/design.md §7).
//!
//! The providers keep their effects in their own tables (`provider_effects`) on
//! their own connection; the engine reaches them only through [`Downstream`].

mod faults;

use std::path::Path;
use std::sync::Mutex;

use serde_json::Value;

pub use faults::{Fault, FaultParseError, FaultPlan};

use crate::engine::canonical::{canonical_string, sha256_hex};
use crate::engine::clock::Clock;
use crate::engine::contracts::DownstreamKind;
use crate::store::{EffectRow, OpenOptions, Store, StoreError, Sync};

/// What the engine sends downstream.
#[derive(Debug, Clone)]
pub struct DownstreamRequest {
    /// Business intent label (the hashed idempotency scope), for effect counting.
    pub intent: String,
    /// Tool name.
    pub tool: String,
    /// Validated arguments.
    pub arguments: Value,
    /// The request digest; the provider records it beside the effect.
    pub request_sha256: String,
    /// How long the caller waits for this attempt.
    pub timeout_ms: u64,
}

/// Evidence of a committed effect.
#[derive(Clone, PartialEq, Eq)]
pub struct Receipt {
    /// Receipt id.
    pub receipt_id: String,
    /// Downstream request id.
    pub request_id: String,
    /// The request digest the provider recorded.
    pub body_sha256: String,
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
            .field("result", &"<redacted>")
            .field("headers", &header_names)
            .finish()
    }
}

/// What an `execute` returned, as far as the caller can tell.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Committed, reply received.
    Committed(Receipt),
    /// Definitively refused: no effect.
    Rejected {
        /// Provider's reason.
        reason: String,
    },
    /// 429 with Retry-After: provably not accepted.
    RateLimited {
        /// Retry-After.
        retry_after_ms: u64,
    },
    /// 503 before accepting: provably not accepted.
    Unavailable,
    /// The connection was never established: provably not received.
    ConnectTimeout,
    /// Sent, no reply in time: it may or may not have committed.
    TimedOut,
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
}

/// Provider errors that are not replies (the provider's own storage failed).
#[derive(Debug, thiserror::Error)]
pub enum DownstreamError {
    /// Its storage failed.
    #[error("downstream storage: {0}")]
    Store(#[from] StoreError),
}

/// The adapter every downstream implements.
pub trait Downstream: Send {
    /// Which downstream this is.
    fn kind(&self) -> DownstreamKind;
    /// Executes a request under a downstream key.
    fn execute(&mut self, downstream_key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError>;
    /// Looks up what happened under a downstream key.
    fn lookup(&mut self, downstream_key: &str) -> Result<Lookup, DownstreamError>;
}

/// A simulated provider, durable in its own tables, with a fault plan.
pub struct Simulated {
    kind: DownstreamKind,
    store: Store,
    clock: std::sync::Arc<dyn Clock>,
    faults: std::sync::Arc<Mutex<FaultPlan>>,
    ids: crate::engine::ids::Ids,
}

impl std::fmt::Debug for Simulated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulated").field("kind", &self.kind).finish_non_exhaustive()
    }
}

impl Simulated {
    /// Opens a simulated provider on the database file.
    pub fn open(
        kind: DownstreamKind,
        path: &Path,
        clock: std::sync::Arc<dyn Clock>,
        faults: std::sync::Arc<Mutex<FaultPlan>>,
        sync: Sync,
        ids: crate::engine::ids::Ids,
    ) -> Result<Self, DownstreamError> {
        let store = Store::open(path, OpenOptions { create: false, sync })?;
        Ok(Self { kind, store, clock, faults, ids })
    }

    /// The provider beside a ledger opened read-only: lookups work, a commit is `DB_READ_ONLY`.
    pub fn open_read_only(
        kind: DownstreamKind,
        path: &Path,
        clock: std::sync::Arc<dyn Clock>,
        faults: std::sync::Arc<Mutex<FaultPlan>>,
        ids: crate::engine::ids::Ids,
    ) -> Result<Self, DownstreamError> {
        Ok(Self { kind, store: Store::open_read_only(path)?, clock, faults, ids })
    }

    fn next_fault(&self) -> Fault {
        self.faults.lock().map_or(Fault::Ok, |mut f| f.next_fault())
    }

    fn commit(
        &mut self,
        key: &str,
        req: &DownstreamRequest,
        visible_delay_ms: u64,
        drift: bool,
    ) -> Result<Result<Receipt, String>, DownstreamError> {
        let now = self.clock.now_ms();
        let provider = self.kind.as_str();
        let honours_keys = self.kind.honours_keys();
        let effect = self.store.write(|tx| -> Result<_, StoreError> {
            if honours_keys {
                if let Some(e) = tx.provider_effect_by_key(provider, key)? {
                    // Same key: same body → the original effect; other body → conflict.
                    return Ok(if e.body_sha256 == req.request_sha256 || drift {
                        Ok(e)
                    } else {
                        Err("idempotency key reused with a different body".to_string())
                    });
                }
            }
            let request_id = self.ids.id_n::<8>("dreq");
            let receipt_id = self.ids.id_n::<8>("rcpt");
            let mut result = result_for(self.kind, req, &self.ids);
            let mut body = req.request_sha256.clone();
            if drift {
                // Provider state drifted: the effect it recorded is not the one we asked for.
                body = sha256_hex(format!("drift:{body}").as_bytes());
                if let Some(obj) = result.as_object_mut() {
                    if let Some(Value::Number(n)) = obj.get("amount_minor").cloned() {
                        obj.insert("amount_minor".into(), Value::from(n.as_i64().unwrap_or(1) + 1));
                    }
                }
            }
            let row = EffectRow {
                provider: provider.to_string(),
                downstream_key: key.to_string(),
                intent: req.intent.clone(),
                body_sha256: body,
                request_id,
                receipt_id,
                result_json: canonical_string(&result),
                committed_at: now,
                visible_at: now + visible_delay_ms as i64,
            };
            tx.insert_provider_effect(&row)?;
            Ok(Ok(row))
        })?;
        // The effect is durable downstream; the engine has not heard of it yet.
        crate::failpoint::hit("after_provider_commit");
        Ok(effect.map(|e| receipt_of(&e)))
    }
}

fn receipt_of(e: &EffectRow) -> Receipt {
    Receipt {
        receipt_id: e.receipt_id.clone(),
        request_id: e.request_id.clone(),
        body_sha256: e.body_sha256.clone(),
        result: serde_json::from_str(&e.result_json).unwrap_or(Value::Null),
        headers: vec![("x-request-id".to_string(), e.request_id.clone())],
    }
}

fn result_for(kind: DownstreamKind, req: &DownstreamRequest, ids: &crate::engine::ids::Ids) -> Value {
    let a = &req.arguments;
    match kind {
        DownstreamKind::Payments => serde_json::json!({
            "refund_id": ids.id_n::<8>("re"),
            "order_ref": a.get("order_ref").cloned().unwrap_or(Value::Null),
            "amount_minor": a.get("amount_minor").cloned().unwrap_or(Value::Null),
            "currency": a.get("currency").cloned().unwrap_or(Value::Null),
            "status": "succeeded",
        }),
        DownstreamKind::Notifications => serde_json::json!({
            "message_id": ids.id_n::<8>("msg"),
            "order_ref": a.get("order_ref").cloned().unwrap_or(Value::Null),
            "template": a.get("template").cloned().unwrap_or(Value::Null),
            "status": "sent",
        }),
        DownstreamKind::Orders => Value::Null,
    }
}

impl Downstream for Simulated {
    fn kind(&self) -> DownstreamKind {
        self.kind
    }

    fn execute(&mut self, key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError> {
        let fault = self.next_fault();
        Ok(match fault {
            Fault::Ok => match self.commit(key, req, 0, false)? {
                Ok(r) => Reply::Committed(r),
                Err(reason) => Reply::Rejected { reason },
            },
            Fault::Latency(ms) if ms > req.timeout_ms => {
                // The caller waits no longer than its timeout (the attempt timeout
                // capped by the operation deadline) and gives up. The provider
                // goes on: its effect lands `ms` after the request, so a status
                // lookup finds nothing until then.
                self.clock.sleep_ms(req.timeout_ms);
                let _ = self.commit(key, req, ms - req.timeout_ms, false)?;
                Reply::TimedOut
            }
            Fault::Latency(ms) => {
                self.clock.sleep_ms(ms);
                match self.commit(key, req, 0, false)? {
                    Ok(r) => Reply::Committed(r),
                    Err(reason) => Reply::Rejected { reason },
                }
            }
            Fault::Reject(reason) => Reply::Rejected { reason },
            Fault::EchoCredential { value, in_result } => match self.commit(key, req, 0, false)? {
                Ok(mut r) => {
                    // Only the reply on the wire carries it: the stored effect is clean.
                    r.headers.push(("authorization".to_string(), format!("Bearer {value}")));
                    if in_result {
                        if let Some(obj) = r.result.as_object_mut() {
                            obj.insert("card_token".to_string(), Value::String(value));
                        }
                    }
                    Reply::Committed(r)
                }
                Err(reason) => Reply::Rejected { reason },
            },
            Fault::RateLimit(ms) => Reply::RateLimited { retry_after_ms: ms },
            Fault::Unavailable => Reply::Unavailable,
            Fault::ConnectTimeout => Reply::ConnectTimeout,
            Fault::TimeoutBeforeCommit => Reply::TimedOut,
            Fault::TimeoutAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                Reply::TimedOut
            }
            Fault::ReceiptDelay(ms) => {
                let _ = self.commit(key, req, ms, false)?;
                Reply::TimedOut
            }
            Fault::MismatchAfterCommit => {
                let _ = self.commit(key, req, 0, true)?;
                Reply::TimedOut
            }
            Fault::MalformedResponse => {
                let _ = self.commit(key, req, 0, false)?;
                Reply::Malformed
            }
            Fault::PanicAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                panic!("simulated handler panic after commit");
            }
            Fault::CrashAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                // A real crash: no unwinding, no destructors, no result persisted.
                std::process::abort();
            }
        })
    }

    fn lookup(&mut self, key: &str) -> Result<Lookup, DownstreamError> {
        let now = self.clock.now_ms();
        let provider = self.kind.as_str();
        let found = self.store.read(|tx| tx.provider_effect_by_key(provider, key))?;
        Ok(match found {
            Some(e) if e.visible_at <= now => Lookup::Found(receipt_of(&e)),
            _ => Lookup::NotFound,
        })
    }
}
