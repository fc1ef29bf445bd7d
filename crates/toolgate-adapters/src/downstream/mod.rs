//! Downstream providers: the adapter trait and the simulated, durable payments and
//! notifications providers with their fault plans (docs/design.md §7).
//!
//! The providers keep their effects in their own tables (`provider_effects`) on
//! their own connection; the engine reaches them only through [`Downstream`].

pub mod http;
pub mod http_map;
#[cfg(feature = "mcp")]
pub mod mcp;
pub mod serve;

use std::sync::Mutex;

use serde_json::Value;

pub use crate::engine::faults::{Fault, FaultParseError, FaultPlan};
pub use crate::engine::tool::{
    Downstream, DownstreamContext, DownstreamError, DownstreamFactory, DownstreamRequest, EffectCounts, Lookup,
    Receipt, Reply,
};

use crate::engine::canonical::{canonical_string, sha256_hex};
use crate::engine::clock::Clock;
use crate::engine::contracts::{Contract, DownstreamRef};
use crate::store::{EffectRow, OpenOptions, ProviderStore, StoreError};

/// Which simulated provider: payments honours keys, notifications does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimKind {
    /// Payments: honours idempotency keys.
    Payments,
    /// Notifications: does not de-duplicate.
    Notifications,
}

impl SimKind {
    /// By downstream name.
    pub fn of(name: &str) -> Option<SimKind> {
        match name {
            "payments" => Some(SimKind::Payments),
            "notifications" => Some(SimKind::Notifications),
            _ => None,
        }
    }

    /// Stable name (the provider column of its effects).
    pub fn as_str(self) -> &'static str {
        match self {
            SimKind::Payments => "payments",
            SimKind::Notifications => "notifications",
        }
    }

    /// Whether it honours idempotency keys.
    pub fn honours_keys(self) -> bool {
        self == SimKind::Payments
    }
}

/// The `simulated` adapter: opens the demo providers beside the ledger.
#[derive(Debug, Clone, Copy, Default)]
pub struct SimulatedAdapter;

impl DownstreamFactory for SimulatedAdapter {
    fn check(&self, c: &Contract) -> Result<(), (String, String)> {
        let d = &c.downstream;
        let Some(kind) = SimKind::of(&d.name) else {
            return Err(("name".into(), "the simulated adapter serves `payments` and `notifications`".into()));
        };
        if c.effect == crate::engine::contracts::Effect::Read {
            return Err((
                "adapter".into(),
                "the simulated providers execute payments and notifications; a read tool is answered by `local` or `http`".into(),
            ));
        }
        if d.http.is_some() {
            return Err(("http".into(), "only the http adapter takes http settings".into()));
        }
        if d.mcp.is_some() {
            return Err(("mcp".into(), "only the mcp adapter takes mcp settings".into()));
        }
        if d.dedupes_keys != kind.honours_keys() {
            return Err((
                "dedupes_keys".into(),
                format!(
                    "the simulated {} provider {} de-duplicate by key",
                    kind.as_str(),
                    if kind.honours_keys() { "does" } else { "does not" }
                ),
            ));
        }
        Ok(())
    }

    fn open(&self, d: &DownstreamRef, ctx: &DownstreamContext<'_>) -> Result<Box<dyn Downstream>, DownstreamError> {
        let kind = SimKind::of(&d.name).ok_or_else(|| DownstreamError::Setup {
            name: d.name.clone(),
            reason: "not a simulated provider".into(),
        })?;
        let store = if ctx.read_only {
            ProviderStore::open_read_only(ctx.ledger_path)?
        } else {
            ProviderStore::open(ctx.ledger_path, OpenOptions { create: false, sync: ctx.sync })?
        };
        Ok(Box::new(Simulated {
            kind,
            store,
            clock: ctx.clock.clone(),
            faults: ctx.faults.clone(),
            ids: ctx.ids.clone(),
        }))
    }
}

/// A simulated provider, durable in its own tables, with a fault plan.
pub struct Simulated {
    kind: SimKind,
    store: ProviderStore,
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
    /// Opens a simulated provider on the database file (its tables sit beside the ledger's).
    pub fn open(
        kind: SimKind,
        path: &std::path::Path,
        clock: std::sync::Arc<dyn Clock>,
        faults: std::sync::Arc<Mutex<FaultPlan>>,
        sync: crate::store::Sync,
        ids: crate::engine::ids::Ids,
    ) -> Result<Self, DownstreamError> {
        let store = ProviderStore::open(path, OpenOptions { create: false, sync })?;
        Ok(Self { kind, store, clock, faults, ids })
    }

    fn next_fault(&self) -> Fault {
        self.faults.lock().map_or(Fault::Ok, |mut f| f.next_fault())
    }

    /// Commits an effect under a key (the same key with the same body finds the
    /// original; another body is refused), visible to lookups after
    /// `visible_delay_ms`; `drift` records something other than what was asked.
    pub fn commit(
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
            if self.kind == SimKind::Payments && !drift {
                // As a real payment service: never refund more than remains of the charge.
                let order = req.arguments.get("order_ref").and_then(Value::as_str).unwrap_or_default();
                let amount = req.arguments.get("amount_minor").and_then(Value::as_i64).unwrap_or(0);
                if tx.take_from_charge(provider, order, amount)? == Some(false) {
                    return Ok(Err("refund exceeds what remains of the charge".to_string()));
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
        body_sha256: Some(e.body_sha256.clone()),
        key: Some(e.downstream_key.clone()),
        result: serde_json::from_str(&e.result_json).unwrap_or(Value::Null),
        headers: vec![("x-request-id".to_string(), e.request_id.clone())],
    }
}

fn result_for(kind: SimKind, req: &DownstreamRequest, ids: &crate::engine::ids::Ids) -> Value {
    let a = &req.arguments;
    match kind {
        SimKind::Payments => serde_json::json!({
            "refund_id": ids.id_n::<8>("re"),
            "order_ref": a.get("order_ref").cloned().unwrap_or(Value::Null),
            "amount_minor": a.get("amount_minor").cloned().unwrap_or(Value::Null),
            "currency": a.get("currency").cloned().unwrap_or(Value::Null),
            "status": "succeeded",
        }),
        SimKind::Notifications => serde_json::json!({
            "message_id": ids.id_n::<8>("msg"),
            "order_ref": a.get("order_ref").cloned().unwrap_or(Value::Null),
            "template": a.get("template").cloned().unwrap_or(Value::Null),
            "status": "sent",
        }),
    }
}

impl Downstream for Simulated {
    fn execute(&mut self, key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError> {
        let fault = self.next_fault();
        Ok(match fault {
            Fault::Ok => match self.commit(key, req, 0, false)? {
                Ok(r) => Reply::Committed(r),
                Err(reason) => Reply::Rejected { reason, refusal: None },
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
                    Err(reason) => Reply::Rejected { reason, refusal: None },
                }
            }
            Fault::Reject(reason) => Reply::Rejected { reason, refusal: None },
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
                Err(reason) => Reply::Rejected { reason, refusal: None },
            },
            Fault::RateLimit(ra) => Reply::RateLimited { retry_after_ms: ra.ms },
            Fault::Unavailable(ra) => Reply::Unavailable { retry_after_ms: ra.map(|r| r.ms) },
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
            Fault::DropAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                Reply::TimedOut
            }
            Fault::InProgress(ms) => Reply::InProgress { retry_after_ms: Some(ms) },
            Fault::ServerErrorAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                Reply::ServerError
            }
            // In process there is no configuration that says a 5xx means "not
            // committed": a server error is one that may have committed.
            Fault::ServerError => Reply::ServerError,
            Fault::SlowBody(ms) if ms > req.timeout_ms => {
                // Committed; the caller stops reading the receipt at its timeout.
                let _ = self.commit(key, req, 0, false)?;
                self.clock.sleep_ms(req.timeout_ms);
                Reply::TimedOut
            }
            Fault::SlowBody(ms) => {
                let committed = self.commit(key, req, 0, false)?;
                self.clock.sleep_ms(ms);
                match committed {
                    Ok(r) => Reply::Committed(r),
                    Err(reason) => Reply::Rejected { reason, refusal: None },
                }
            }
            Fault::HugeBody(_) => {
                // Committed; the receipt is larger than the caller reads.
                let _ = self.commit(key, req, 0, false)?;
                Reply::Malformed
            }
            Fault::CrashAfterCommit => {
                let _ = self.commit(key, req, 0, false)?;
                // A real crash: no unwinding, no destructors, no result persisted.
                std::process::abort();
            }
        })
    }

    fn lookup(&mut self, key: &str, _timeout_ms: u64) -> Result<Lookup, DownstreamError> {
        let now = self.clock.now_ms();
        let provider = self.kind.as_str();
        let found = self.store.read(|tx| tx.provider_effect_by_key(provider, key))?;
        Ok(match found {
            Some(e) if e.visible_at <= now => Lookup::Found(receipt_of(&e)),
            _ => Lookup::NotFound,
        })
    }

    fn effect_counts(&mut self) -> Result<Option<EffectCounts>, DownstreamError> {
        let (effects, duplicates) = self
            .store
            .read(|tx| -> Result<_, StoreError> { Ok((tx.count_effects()?, tx.side_effect_duplicates()?)) })?;
        Ok(Some(EffectCounts { effects, duplicates }))
    }

    fn own_effect_counts(&mut self) -> Result<Option<EffectCounts>, DownstreamError> {
        let provider = self.kind.as_str();
        let (effects, duplicates) = self.store.read(|tx| tx.effect_counts_of(provider))?;
        Ok(Some(EffectCounts { effects, duplicates }))
    }

    fn effects_for_intent(&mut self, intent: &str) -> Result<Option<i64>, DownstreamError> {
        Ok(Some(self.store.read(|tx| tx.count_effects_for_intent(intent))?))
    }

    fn paid_by_order(&mut self) -> Result<Option<std::collections::BTreeMap<String, i64>>, DownstreamError> {
        if self.kind != SimKind::Payments {
            return Ok(None);
        }
        let provider = self.kind.as_str();
        Ok(Some(self.store.read(|tx| tx.paid_by_order(provider))?))
    }

    fn load_world(&mut self, world: &crate::engine::world::World) -> Result<(), DownstreamError> {
        if self.kind != SimKind::Payments {
            return Ok(());
        }
        let provider = self.kind.as_str();
        let orders = crate::tools::demo::orders_of(world).map_err(StoreError::Other)?;
        self.store.write(|tx| -> Result<(), StoreError> {
            for o in &orders {
                tx.insert_charge(provider, &o.order_ref, &o.currency, o.captured_minor, o.refunded_minor)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}
