//! The demo world's domain: orders owned by subjects, `get_order` answered
//! from them, `create_refund`'s rules (refundable, same currency, within what
//! is left) and its balance update, and the audit of the balances against the
//! ledger's succeeded refunds. `notify_customer` only needs the order to be
//! the caller's. Its orders live in its own store module ([`store`]), reached
//! through the step's [`DomainTx`], not the ledger's transaction.

use serde_json::{json, Value};

pub mod store;

use crate::engine::tool::{Hold, ToolCall, ToolDomain};
use crate::engine::world::World;
use crate::engine::{Engine, EngineError};
use crate::store::{DomainTx, StoreError};
pub use store::OrderRow;

/// The tools this domain serves.
pub const TOOLS: [&str; 3] = ["get_order", "create_refund", "notify_customer"];

/// The demo world's domain.
#[derive(Debug, Clone, Copy, Default)]
pub struct DemoDomain;

/// The balance a refund of an order holds on.
pub fn resource(order_ref: &str) -> String {
    format!("order:{order_ref}")
}

/// A refund's amount in minor units: an integer, also when written with a
/// zero fraction (`500.0`, which the schema's `integer` accepts and the
/// canonical form writes as `500`). `None` for anything else.
fn amount(call: &ToolCall<'_>) -> Option<i64> {
    let v = call.arguments.get("amount_minor")?;
    v.as_i64().or_else(|| {
        let f = v.as_f64()?;
        // Exactly an integer within i64 (the schema caps amounts far below 2^53).
        (f.fract() == 0.0 && f.abs() < 9.0e15).then_some(f as i64)
    })
}

fn order_ref<'a>(call: &ToolCall<'a>) -> Option<&'a str> {
    call.arguments.get("order_ref").and_then(Value::as_str)
}

/// Every order of the ledger's demo world, in order_ref order (`toolgate
/// orders`, the load generator's referee, tests).
pub fn orders(engine: &mut Engine) -> Result<Vec<OrderRow>, EngineError> {
    engine.read(|tx| -> Result<_, EngineError> { Ok(store::orders(&tx.domain())?) })
}

impl ToolDomain for DemoDomain {
    fn visible(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>) -> Result<bool, StoreError> {
        let Some(r) = order_ref(call) else { return Ok(true) };
        // Not owned, cross-tenant and nonexistent look the same.
        Ok(store::order(tx, r)?.is_some_and(|o| o.tenant == call.tenant && o.owner == call.subject))
    }

    fn rules(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>) -> Result<Option<&'static str>, StoreError> {
        if call.tool != "create_refund" {
            return Ok(None);
        }
        let order_ref = order_ref(call).unwrap_or_default();
        // On PostgreSQL the writes are SERIALIZABLE: the read of what is held
        // below conflicts with a concurrent accept's new hold, and one of the two
        // is retried by the store. The row lock makes accepts of one order queue
        // behind each other instead of both running to that conflict.
        let Some(o) = store::order_for_update(tx, order_ref)? else {
            return Ok(Some("order_missing"));
        };
        let Some(amount) = amount(call) else {
            return Ok(Some("amount_invalid"));
        };
        let currency = call.arguments.get("currency").and_then(Value::as_str).unwrap_or_default();
        if o.status == "refunded" {
            return Ok(Some("order_not_refundable"));
        }
        if currency != o.currency {
            return Ok(Some("currency_mismatch"));
        }
        // What is left is what no refund took and no accepted refund holds (its
        // own hold excepted when an accepted operation is checked again).
        let held = tx.held_on(&resource(order_ref), call.operation_id)?;
        if amount > o.captured_minor - o.refunded_minor - held {
            return Ok(Some("amount_exceeds_remaining"));
        }
        Ok(None)
    }

    fn load_world(&self, tx: &DomainTx<'_, '_>, world: &World) -> Result<(), StoreError> {
        for o in &world.orders {
            store::insert_order(
                tx,
                &OrderRow {
                    order_ref: o.order_ref.clone(),
                    tenant: o.tenant.clone(),
                    owner: o.owner.clone(),
                    currency: o.currency.clone(),
                    captured_minor: o.captured_minor,
                    refunded_minor: o.refunded_minor,
                    status: o.status.clone(),
                    revision: 1,
                    over_refunded_minor: 0,
                },
            )?;
        }
        Ok(())
    }

    fn hold(&self, call: &ToolCall<'_>) -> Option<Hold> {
        let amount = amount(call)?;
        let order = order_ref(call)?;
        (call.tool == "create_refund" && amount > 0).then(|| Hold { resource: resource(order), amount })
    }

    fn apply(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>, _result: &Value) -> Result<Option<String>, StoreError> {
        if call.tool != "create_refund" {
            return Ok(None);
        }
        let amount = amount(call).unwrap_or(0);
        let order_ref = order_ref(call).unwrap_or_default();
        let over = store::order(tx, order_ref)?.map_or(0, |o| (o.refunded_minor + amount - o.captured_minor).max(0));
        store::apply_refund(tx, order_ref, amount)?;
        Ok((over > 0).then(|| format!("refund paid {over} above the capture of {order_ref} (over_captured)")))
    }

    fn revert(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>, _result: &Value) -> Result<(), StoreError> {
        if call.tool == "create_refund" {
            store::revert_refund(tx, order_ref(call).unwrap_or_default(), amount(call).unwrap_or(0))?;
        }
        Ok(())
    }

    fn context(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>) -> Result<Vec<(String, String)>, StoreError> {
        let Some(o) = store::order(tx, order_ref(call).unwrap_or_default())? else { return Ok(Vec::new()) };
        let held = tx.held_on(&resource(&o.order_ref), None)?;
        let own = match call.operation_id {
            Some(id) => tx.hold_of(id)?.map_or(0, |(_, amount)| amount),
            None => 0,
        };
        let m = |minor: i64| crate::display::money(minor, &o.currency);
        let mut lines = vec![
            ("order".to_string(), format!("{} ({})", o.order_ref, o.status)),
            (
                "balance".to_string(),
                format!(
                    "captured {} · refunded {} · held {} · remaining {}",
                    m(o.captured_minor),
                    m(o.refunded_minor),
                    m(held),
                    m(o.captured_minor - o.refunded_minor - held)
                ),
            ),
        ];
        if own > 0 {
            lines.push(("this call holds".to_string(), m(own)));
        }
        if o.over_refunded_minor > 0 {
            lines.push(("PAID ABOVE CAPTURE".to_string(), m(o.over_refunded_minor)));
        }
        Ok(lines)
    }

    fn read(&self, tx: &DomainTx<'_, '_>, call: &ToolCall<'_>) -> Result<Option<Value>, StoreError> {
        Ok(store::order(tx, order_ref(call).unwrap_or_default())?.map(|o| {
            json!({
                "order_ref": o.order_ref, "currency": o.currency, "captured_minor": o.captured_minor,
                "refunded_minor": o.refunded_minor, "status": o.status,
            })
        }))
    }

    /// Each order's `refunded_minor` covers at least the refunds the ledger holds
    /// as succeeded (the world file's starting balance is not kept, so a balance
    /// above the ledger's refunds is not a finding), and its status matches it.
    fn audit(
        &self,
        tx: &DomainTx<'_, '_>,
        succeeded: &[(ToolCall<'_>, Value)],
        find: &mut dyn FnMut(&str, &str, &str),
    ) -> Result<(), StoreError> {
        let mut refunded: std::collections::BTreeMap<&str, i64> = std::collections::BTreeMap::new();
        for (call, _) in succeeded.iter().filter(|(c, _)| c.tool == "create_refund") {
            if let (Some(order), Some(amount)) =
                (order_ref(call), call.arguments.get("amount_minor").and_then(Value::as_i64))
            {
                *refunded.entry(order).or_default() += amount;
            }
        }
        let mut holds: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
        for (_, r, amount) in tx.holds()? {
            *holds.entry(r).or_default() += amount;
        }
        for o in store::orders(tx)? {
            if o.over_refunded_minor > 0 {
                find(
                    "order",
                    &o.order_ref,
                    &format!(
                        "{} was paid above the capture of {} (over_captured): refunds the order did not have",
                        o.over_refunded_minor, o.captured_minor
                    ),
                );
            }
            let on_hold = holds.get(&resource(&o.order_ref)).copied().unwrap_or(0);
            if o.refunded_minor + on_hold > o.captured_minor {
                find(
                    "order",
                    &o.order_ref,
                    &format!(
                        "refunded {} and held {on_hold} add up to more than the capture of {}",
                        o.refunded_minor, o.captured_minor
                    ),
                );
            }
            let held = refunded.get(o.order_ref.as_str()).copied().unwrap_or(0);
            if o.refunded_minor + o.over_refunded_minor < held {
                find(
                    "order",
                    &o.order_ref,
                    &format!(
                        "refunded_minor {} is below the {held} the ledger's succeeded refunds add up to",
                        o.refunded_minor + o.over_refunded_minor
                    ),
                );
            }
            let expected = match o.refunded_minor {
                0 => "paid",
                r if r == o.captured_minor => "refunded",
                _ => "partially_refunded",
            };
            if o.status != expected {
                find(
                    "order",
                    &o.order_ref,
                    &format!("status {} does not match refunded_minor {}", o.status, o.refunded_minor),
                );
            }
        }
        Ok(())
    }
}
