//! The world: tenants with approvers and thresholds, subjects, grants and orders,
//! loaded from a JSON world file (SPEC §1).

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
    /// Orders.
    pub orders: Vec<OrderSpec>,
}

fn bad(message: impl Into<String>) -> EngineError {
    EngineError::invalid("WORLD_INVALID", message)
}

impl World {
    /// Parses and checks a world file (strict: duplicate keys, unknown fields,
    /// dangling references and impossible amounts are refused).
    pub fn parse(text: &[u8]) -> Result<World, EngineError> {
        let v = parse_strict(text, MAX_WORLD_BYTES, 16).map_err(|e| bad(format!("world file: {e}")))?;
        let w: World = serde_json::from_value(v).map_err(|e| bad(format!("world file: {e}")))?;
        w.check()?;
        Ok(w)
    }

    fn check(&self) -> Result<(), EngineError> {
        let ident = |s: &str| {
            !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.@".contains(c))
        };
        let tenants: std::collections::HashSet<&str> = self.tenants.iter().map(|t| t.id.as_str()).collect();
        if tenants.len() != self.tenants.len() {
            return Err(bad("world file: duplicate tenant id"));
        }
        for t in &self.tenants {
            if !ident(&t.id) || t.approvers.iter().any(|a| !ident(a)) {
                return Err(bad("world file: tenant and approver ids must be 1..128 of [A-Za-z0-9_-.@]"));
            }
            if t.approval_threshold_minor < 0 {
                return Err(bad(format!("world file: tenant {}: approval_threshold_minor must be >= 0", t.id)));
            }
        }
        let mut subjects = std::collections::HashMap::new();
        for s in &self.subjects {
            if !ident(&s.id) || !tenants.contains(s.tenant.as_str()) {
                return Err(bad(format!("world file: subject {:?}: bad id or unknown tenant", s.id)));
            }
            if subjects.insert(s.id.as_str(), s.tenant.as_str()).is_some() {
                return Err(bad(format!("world file: duplicate subject {:?}", s.id)));
            }
        }
        for g in &self.grants {
            if subjects.get(g.subject.as_str()) != Some(&g.tenant.as_str()) {
                return Err(bad(format!("world file: grant for {:?}: subject not in tenant", g.subject)));
            }
        }
        for o in &self.orders {
            if subjects.get(o.owner.as_str()) != Some(&o.tenant.as_str()) {
                return Err(bad(format!("world file: order {:?}: owner not in tenant", o.order_ref)));
            }
            let ok_status = matches!(o.status.as_str(), "paid" | "partially_refunded" | "refunded");
            if !ok_status
                || o.captured_minor < 0
                || o.refunded_minor < 0
                || o.refunded_minor > o.captured_minor
                || o.currency.len() != 3
                || !o.order_ref.starts_with("ord_")
            {
                return Err(bad(format!(
                    "world file: order {:?}: impossible amounts, currency or status",
                    o.order_ref
                )));
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Loads a world into an empty database (one transaction: all or nothing).
    pub fn load_world(&mut self, world: &World) -> Result<(), EngineError> {
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
                })?;
            }
            tx.meta_set("world_loaded", &now.to_string())?;
            Ok(())
        })
    }

    /// All orders.
    pub fn orders(&mut self) -> Result<Vec<OrderRow>, EngineError> {
        Ok(self.store.read(|tx| -> Result<_, StoreError> { tx.orders() })?)
    }
}
