//! The world: tenants with approvers and thresholds, subjects, grants and orders,
//! loaded from a JSON world file (docs/design.md §1).

use serde::Deserialize;

use super::canonical::parse_strict;
use super::{Engine, EngineError};
use crate::store::{OrderRow, StoreError};

/// The demo world shipped in `assets/`.
pub const DEMO_WORLD: &str = include_str!("../../assets/world.json");

/// Largest world file accepted.
const MAX_WORLD_BYTES: usize = 16 * 1024 * 1024;

/// A tenant.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Id.
    pub id: String,
    /// Approver allowlist.
    pub approvers: Vec<String>,
    /// Refunds above this amount need approval.
    pub approval_threshold_minor: i64,
}

/// A subject.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubjectSpec {
    /// Id.
    pub id: String,
    /// Tenant.
    pub tenant: String,
}

/// A grant.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct GrantSpec {
    /// Tenant.
    pub tenant: String,
    /// Subject.
    pub subject: String,
    /// Tool.
    pub tool: String,
}

/// An order.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
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

/// A whole world file.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct World {
    /// Tenants.
    pub tenants: Vec<TenantSpec>,
    /// Subjects.
    pub subjects: Vec<SubjectSpec>,
    /// Grants.
    pub grants: Vec<GrantSpec>,
    /// Orders (the demo domain's data; a world for other tools has none).
    #[serde(default)]
    pub orders: Vec<OrderSpec>,
}

impl Engine {
    /// A world that cannot work with this catalog is refused whole, naming
    /// the record: a grant of a tool the catalog lacks (the `grant` command
    /// refuses it too), or an order whose ref the catalog's `order_ref`
    /// schema never accepts (no call could ever name it).
    fn check_world_against_catalog(&self, world: &World) -> Result<(), EngineError> {
        for (i, g) in world.grants.iter().enumerate() {
            if self.contracts.get(&g.tool).is_none() {
                return Err(bad(format!(
                    "grants[{i}]: tool {:?} is not in the catalog (granted to {} in {})",
                    g.tool, g.subject, g.tenant
                )));
            }
        }
        for c in self.contracts.all() {
            let Some(schema) = c.input_schema.get("properties").and_then(|p| p.get("order_ref")) else { continue };
            let Ok(v) = jsonschema::validator_for(schema) else { continue };
            for (i, o) in world.orders.iter().enumerate() {
                if !v.is_valid(&serde_json::Value::String(o.order_ref.clone())) {
                    return Err(bad(format!(
                        "orders[{i}]: order_ref {:?} never fits {}'s input schema (properties.order_ref), so no call could name it",
                        o.order_ref, c.name
                    )));
                }
            }
        }
        Ok(())
    }
}

fn bad(message: impl Into<String>) -> EngineError {
    EngineError::invalid("WORLD_INVALID", message)
}

/// The character set of every id in a world file (tenants, approvers,
/// subjects, order refs): 1 to 128 of `A-Z a-z 0-9 _ - . @ :`.
pub const ID_RULE: &str = "1 to 128 characters of A-Z a-z 0-9 _ - . @ :";

fn valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.@:".contains(c))
}

impl World {
    /// Parses and checks a world file (strict: duplicate keys, unknown fields,
    /// dangling references and impossible amounts are refused).
    pub fn parse(text: &[u8]) -> Result<World, EngineError> {
        Self::parse_named("world file", text)
    }

    /// [`World::parse`], naming the file in every refusal (pass the name the
    /// user gave, not a resolved path).
    pub fn parse_named(file: &str, text: &[u8]) -> Result<World, EngineError> {
        let v = parse_strict(text, MAX_WORLD_BYTES, 16).map_err(|e| bad(format!("{file}: {e}")))?;
        let w: World = serde_json::from_value(v).map_err(|e| bad(format!("{file}: {e}")))?;
        w.check().map_err(|why| bad(format!("{file}: {why}")))?;
        Ok(w)
    }

    /// The first rule a record breaks, as "record: field `f`: rule".
    fn check(&self) -> Result<(), String> {
        let fail = |record: String, field: &str, rule: &str| Err(format!("{record}: field `{field}`: {rule}"));
        let mut tenants = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let rec = format!("tenants[{i}] ({:?})", t.id);
            if !valid_id(&t.id) {
                return fail(rec, "id", &format!("must be {ID_RULE}"));
            }
            if !tenants.insert(t.id.as_str()) {
                return fail(rec, "id", "duplicate tenant id");
            }
            if let Some(a) = t.approvers.iter().find(|a| !valid_id(a)) {
                return fail(rec, "approvers", &format!("approver {a:?} must be {ID_RULE}"));
            }
            if t.approval_threshold_minor < 0 {
                return fail(rec, "approval_threshold_minor", "must be 0 or more");
            }
        }
        let mut subjects = std::collections::HashMap::new();
        for (i, s) in self.subjects.iter().enumerate() {
            let rec = format!("subjects[{i}] ({:?})", s.id);
            if !valid_id(&s.id) {
                return fail(rec, "id", &format!("must be {ID_RULE}"));
            }
            if !tenants.contains(s.tenant.as_str()) {
                return fail(rec, "tenant", "must name a tenant of this file");
            }
            if subjects.insert(s.id.as_str(), s.tenant.as_str()).is_some() {
                return fail(rec, "id", "duplicate subject id");
            }
        }
        for (i, g) in self.grants.iter().enumerate() {
            let rec = format!("grants[{i}] ({:?})", g.subject);
            if !tenants.contains(g.tenant.as_str()) {
                return fail(rec, "tenant", "must name a tenant of this file");
            }
            if subjects.get(g.subject.as_str()) != Some(&g.tenant.as_str()) {
                return fail(rec, "subject", "must name a subject of the grant's tenant");
            }
            if !valid_id(&g.tool) {
                return fail(rec, "tool", &format!("must be {ID_RULE}"));
            }
        }
        let mut orders = std::collections::HashSet::new();
        for (i, o) in self.orders.iter().enumerate() {
            let rec = format!("orders[{i}] ({:?})", o.order_ref);
            if !valid_id(&o.order_ref) {
                return fail(rec, "order_ref", &format!("must be {ID_RULE}"));
            }
            if !orders.insert(o.order_ref.as_str()) {
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
            let expected = match o.refunded_minor {
                0 => "paid",
                r if r == o.captured_minor => "refunded",
                _ => "partially_refunded",
            };
            if !matches!(o.status.as_str(), "paid" | "partially_refunded" | "refunded") {
                return fail(rec, "status", "must be paid, partially_refunded or refunded");
            }
            if o.status != expected {
                return fail(rec, "status", &format!("must be {expected} for refunded_minor {}", o.refunded_minor));
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Loads a world into an empty database (one transaction: all or nothing).
    pub fn load_world(&mut self, world: &World) -> Result<(), EngineError> {
        self.check_world_against_catalog(world)?;
        let now = self.clock.now_ms();
        self.store.write(|tx| -> Result<(), EngineError> {
            if tx.meta("world_loaded")?.is_some() {
                return Err(EngineError::invalid("ALREADY_INITIALIZED", "the database already holds a world"));
            }
            for t in &world.tenants {
                tx.insert_tenant(&t.id, t.approval_threshold_minor)?;
                for a in &t.approvers {
                    tx.insert_approver(&t.id, a)?;
                }
            }
            for s in &world.subjects {
                tx.insert_subject(&s.id, &s.tenant)?;
            }
            for g in &world.grants {
                tx.grant(&g.tenant, &g.subject, &g.tool, now)?;
            }
            for o in &world.orders {
                tx.insert_order(&OrderRow {
                    order_ref: o.order_ref.clone(),
                    tenant: o.tenant.clone(),
                    owner: o.owner.clone(),
                    currency: o.currency.clone(),
                    captured_minor: o.captured_minor,
                    refunded_minor: o.refunded_minor,
                    status: o.status.clone(),
                    revision: 1,
                    over_refunded_minor: 0,
                })?;
            }
            tx.meta_set("world_loaded", &now.to_string())?;
            Ok(())
        })?;
        // The downstreams learn it too (the simulated payments provider, the
        // charges it captured), after the ledger's world is in: their seeding
        // is idempotent, so a failure here is mended by loading again.
        for d in self.downstreams.values_mut() {
            d.load_world(world)?;
        }
        Ok(())
    }

    /// All orders.
    pub fn orders(&mut self) -> Result<Vec<OrderRow>, EngineError> {
        Ok(self.store.read(|tx| -> Result<_, StoreError> { tx.orders() })?)
    }

    /// Every hold of an operation that may still take effect: (operation id,
    /// resource, amount), by resource (see [`super::tool::Hold`]).
    pub fn holds(&mut self) -> Result<Vec<(String, String, i64)>, EngineError> {
        Ok(self.store.read(|tx| -> Result<_, StoreError> { tx.holds() })?)
    }
}
