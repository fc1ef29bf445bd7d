//! The demo world's domain: orders owned by subjects, `get_order` answered
//! from them, `create_refund`'s rules (refundable, same currency, within what
//! is left) and its balance update, and the audit of the balances against the
//! ledger's succeeded refunds. `notify_customer` only needs the order to be
//! the caller's. Its orders live in its own store module ([`store`]), reached
//! through the step's [`DomainTx`], not the ledger's transaction.

use serde::Deserialize;
use serde_json::{json, Value};

pub mod store;

use crate::engine::contracts::Contracts;
use crate::engine::tool::{Hold, ToolCall, ToolDomain};
use crate::engine::world::{valid_id, World, ID_RULE};
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

/// The demo world shipped in `assets/`: tenants, subjects, grants and the
/// demo domain's `orders` section.
pub const DEMO_WORLD: &str = include_str!("../../../../../assets/world.json");

/// The world file's section this domain owns.
pub const ORDERS: &str = "orders";

/// An order of a world file's `orders` section.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct OrderSpec {
    /// Reference.
    pub order_ref: String,
    /// Tenant.
    pub tenant: String,
    /// Owner subject.
    pub owner: String,
    /// Currency.
    pub currency: String,
    /// Captured.
    pub captured_minor: i64,
    /// Refunded so far.
    pub refunded_minor: i64,
    /// Status.
    pub status: String,
}

/// The orders of a world file (none when it has no `orders` section), or
/// what is wrong with the section's shape.
pub fn orders_of(world: &World) -> Result<Vec<OrderSpec>, String> {
    match world.sections.get(ORDERS) {
        None => Ok(Vec::new()),
        // Read from the borrowed section, not a copy of it.
        Some(v) => Vec::<OrderSpec>::deserialize(v).map_err(|e| format!("{ORDERS}: {e}")),
    }
}

/// Replaces a world's `orders` section (benches and examples that change
/// the demo world's balances).
pub fn set_orders(world: &mut World, orders: &[OrderSpec]) {
    world.sections.insert(ORDERS.to_string(), serde_json::to_value(orders).unwrap_or_default());
}

/// Gives every order of a world a capture of `captured_minor` (benches and
/// the hotpath example, which must never run out of balance), keeping each
/// order's status true to its refunds.
pub fn raise_captures(world: &mut World, captured_minor: i64) -> Result<(), String> {
    let mut orders = orders_of(world)?;
    for o in &mut orders {
        o.captured_minor = captured_minor.max(o.refunded_minor);
        o.status = store::status_for(o.refunded_minor, o.captured_minor).into();
    }
    set_orders(world, &orders);
    Ok(())
}

/// The first rule an order breaks, as "orders[i] (ref): field `f`: rule".
fn check_orders(world: &World, orders: &[OrderSpec]) -> Result<(), String> {
    let fail = |record: String, field: &str, rule: &str| Err(format!("{record}: field `{field}`: {rule}"));
    let tenants: std::collections::HashSet<&str> = world.tenants.iter().map(|t| t.id.as_str()).collect();
    let subjects: std::collections::HashMap<&str, &str> =
        world.subjects.iter().map(|s| (s.id.as_str(), s.tenant.as_str())).collect();
    let mut seen = std::collections::HashSet::new();
    for (i, o) in orders.iter().enumerate() {
        let rec = format!("orders[{i}] ({:?})", o.order_ref);
        if !valid_id(&o.order_ref) {
            return fail(rec, "order_ref", &format!("must be {ID_RULE}"));
        }
        if !seen.insert(o.order_ref.as_str()) {
            return fail(rec, "order_ref", "duplicate order_ref");
        }
        if !tenants.contains(o.tenant.as_str()) {
            return fail(rec, "tenant", "must name a tenant of this file");
        }
        if subjects.get(o.owner.as_str()) != Some(&o.tenant.as_str()) {
            return fail(rec, "owner", "must name a subject of the order's tenant");
        }
        if !(o.currency.len() == 3 && o.currency.bytes().all(|b| b.is_ascii_uppercase())) {
            return fail(rec, "currency", "must be a 3-letter upper-case currency code (ISO 4217), e.g. EUR");
        }
        if o.captured_minor < 0 {
            return fail(rec, "captured_minor", "must be 0 or more");
        }
        if o.refunded_minor < 0 || o.refunded_minor > o.captured_minor {
            return fail(rec, "refunded_minor", "must be between 0 and captured_minor");
        }
        let expected = store::status_for(o.refunded_minor, o.captured_minor);
        if !matches!(o.status.as_str(), "paid" | "partially_refunded" | "refunded") {
            return fail(rec, "status", "must be paid, partially_refunded or refunded");
        }
        if o.status != expected {
            return fail(rec, "status", &format!("must be {expected} for refunded_minor {}", o.refunded_minor));
        }
    }
    Ok(())
}

/// An order whose ref the catalog's `order_ref` schema never accepts: no call
/// could ever name it.
fn check_orders_against_catalog(orders: &[OrderSpec], catalog: &Contracts) -> Result<(), String> {
    for c in catalog.all() {
        let Some(schema) = c.input_schema.get("properties").and_then(|p| p.get("order_ref")) else { continue };
        let Ok(v) = jsonschema::validator_for(schema) else { continue };
        for (i, o) in orders.iter().enumerate() {
            if !v.is_valid(&Value::String(o.order_ref.clone())) {
                return Err(format!(
                    "orders[{i}]: order_ref {:?} never fits {}'s input schema (properties.order_ref), so no call could name it",
                    o.order_ref, c.name
                ));
            }
        }
    }
    Ok(())
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

    fn world_sections(&self) -> &'static [&'static str] {
        &[ORDERS]
    }

    fn check_world(&self, world: &World, catalog: Option<&Contracts>) -> Result<(), String> {
        let orders = orders_of(world)?;
        check_orders(world, &orders)?;
        catalog.map_or(Ok(()), |c| check_orders_against_catalog(&orders, c))
    }

    fn load_world(&self, tx: &DomainTx<'_, '_>, world: &World) -> Result<(), StoreError> {
        // Checked before the load (`check_world`): a section that does not
        // parse here cannot have got this far.
        for o in &orders_of(world).map_err(StoreError::Other)? {
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
            let expected = store::status_for(o.refunded_minor, o.captured_minor);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raised_captures_still_make_a_world_the_domain_accepts() {
        let mut world = World::parse(DEMO_WORLD.as_bytes()).expect("the demo world parses");
        raise_captures(&mut world, 1_000_000_000_000).expect("orders");
        let orders = orders_of(&world).expect("orders");
        assert!(orders.iter().all(|o| o.captured_minor == 1_000_000_000_000));
        assert!(orders.iter().any(|o| o.refunded_minor > 0), "the demo world has refunded orders to keep true");
        DemoDomain.check_world(&world, None).expect("the raised world passes the domain's checks");
    }
}
