//! The world: tenants with approvers and thresholds, subjects and grants,
//! loaded from a JSON world file (docs/design.md §1). Any other top-level
//! section (the demo domain's `orders`) belongs to a tool's domain: the core
//! keeps it as JSON, refuses a section no domain of the toolset claims, and
//! hands each domain its own to check and load (`ToolDomain::world_sections`,
//! `check_world`, `load_world`).

use std::collections::BTreeMap;

use serde::Deserialize;

use serde_json::json;

use super::canonical::{canonical_string, parse_strict};
use super::{Engine, EngineError};
use crate::store::{AuditRow, Principal, StoreError, Tx};

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

/// A whole world file.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
pub struct World {
    /// Tenants.
    pub tenants: Vec<TenantSpec>,
    /// Subjects.
    pub subjects: Vec<SubjectSpec>,
    /// Grants.
    pub grants: Vec<GrantSpec>,
    /// Every other top-level section, by name, as written: a domain's own
    /// data (the demo's `orders`). Serialized back at the top level.
    #[serde(flatten)]
    pub sections: BTreeMap<String, serde_json::Value>,
}

/// The sections every world file has.
pub const CORE_SECTIONS: [&str; 3] = ["tenants", "subjects", "grants"];

impl Engine {
    /// A world that cannot work with this catalog and toolset is refused
    /// whole, naming the record: a grant of a tool the catalog lacks (the
    /// `grant` command refuses it too), a section no domain claims, or what a
    /// domain refuses in its own section.
    fn check_world_against_catalog(&self, world: &World) -> Result<(), EngineError> {
        for (i, g) in world.grants.iter().enumerate() {
            if self.contracts.get(&g.tool).is_none() {
                return Err(bad(format!(
                    "grants[{i}]: tool {:?} is not in the catalog (granted to {} in {})",
                    g.tool, g.subject, g.tenant
                )));
            }
        }
        // Each domain checks its own sections (the demo's orders against the
        // catalog's `order_ref` schema), and a section none claims is refused.
        self.toolset.check_world("world file", world, Some(&self.contracts))?;
        Ok(())
    }
}

pub(crate) fn bad(message: impl Into<String>) -> EngineError {
    EngineError::invalid("WORLD_INVALID", message)
}

/// The character set of every id in a world file (tenants, approvers,
/// subjects, order refs): 1 to 128 of `A-Z a-z 0-9 _ - . @ :`.
pub const ID_RULE: &str = "1 to 128 characters of A-Z a-z 0-9 _ - . @ :";

/// Whether `s` is an id of [`ID_RULE`].
pub fn valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.@:".contains(c))
}

impl World {
    /// Parses and checks a world file's core sections (strict: duplicate keys,
    /// unknown fields inside a record, dangling references and impossible
    /// amounts are refused). Other top-level sections are kept as written:
    /// [`World::parse_checked`] and the load hand them to the toolset's domains.
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

    /// [`World::parse_named`], then the toolset's checks of the sections that
    /// belong to its domains (see [`super::tool::Toolset::check_world`]; the
    /// checks against the catalog wait for the load): what `toolgate init
    /// --world FILE` runs before it creates anything.
    pub fn parse_checked(file: &str, text: &[u8], toolset: &super::tool::Toolset) -> Result<World, EngineError> {
        let w = Self::parse_named(file, text)?;
        toolset.check_world(file, &w, None)?;
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
            // Each domain seeds its own tables (the demo domain: its orders).
            for (_, domain) in self.toolset.domain_groups() {
                domain.load_world(&tx.domain(), world)?;
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

    /// Every hold of an operation that may still take effect: (operation id,
    /// resource, amount), by resource (see [`super::tool::Hold`]).
    pub fn holds(&mut self) -> Result<Vec<(String, String, i64)>, EngineError> {
        Ok(self.store.read(|tx| -> Result<_, StoreError> { tx.holds() })?)
    }

    /// Adds a tenant to a database that already holds a world (`toolgate
    /// tenant add`), with its approvers, in one transaction with its entry in
    /// the operator log. Refused, changing nothing: an id outside
    /// [`ID_RULE`] or a negative threshold (`WORLD_INVALID`), a tenant that
    /// exists (`TENANT_EXISTS`), an operator name that is not one
    /// (`INVALID_OPERATOR`).
    pub fn add_tenant(&mut self, t: &TenantSpec, operator: &str) -> Result<(), EngineError> {
        super::check_operator(operator)?;
        check_id("tenant", &t.id)?;
        if let Some(a) = t.approvers.iter().find(|a| !valid_id(a)) {
            return Err(bad(format!("approver {a:?}: must be {ID_RULE}")));
        }
        if t.approval_threshold_minor < 0 {
            return Err(bad("approval_threshold_minor: must be 0 or more"));
        }
        let now = self.clock.now_ms();
        self.store.write(|tx| -> Result<(), EngineError> {
            if tx.tenant_exists(&t.id)? {
                return Err(EngineError::invalid("TENANT_EXISTS", format!("tenant {:?} already exists", t.id)));
            }
            tx.insert_tenant(&t.id, t.approval_threshold_minor)?;
            let mut approvers: Vec<&str> = t.approvers.iter().map(String::as_str).collect();
            approvers.sort_unstable();
            approvers.dedup();
            for a in &approvers {
                tx.insert_approver(&t.id, a)?;
            }
            let evidence =
                json!({"tenant": t.id, "approvers": approvers, "approval_threshold_minor": t.approval_threshold_minor});
            log_world_change(tx, now, operator, "tenant_add", &format!("tenant {} added", t.id), &evidence)?;
            Ok(())
        })
    }

    /// Adds a subject to an existing tenant (`toolgate subject add`), with
    /// its entry in the operator log; it holds no grant yet (`toolgate
    /// grant`). Refused, changing nothing: `WORLD_INVALID` for an id outside
    /// [`ID_RULE`], `UNKNOWN_TENANT`, `SUBJECT_EXISTS` (subject ids are
    /// unique across tenants).
    pub fn add_subject(&mut self, tenant: &str, subject: &str, operator: &str) -> Result<(), EngineError> {
        super::check_operator(operator)?;
        check_id("subject", subject)?;
        let now = self.clock.now_ms();
        self.store.write(|tx| -> Result<(), EngineError> {
            if !tx.tenant_exists(tenant)? {
                return Err(EngineError::invalid("UNKNOWN_TENANT", "no such tenant"));
            }
            if let Some(other) = tx.subject_tenant(subject)? {
                let whose = if other == tenant { "this tenant" } else { "another tenant" };
                return Err(EngineError::invalid(
                    "SUBJECT_EXISTS",
                    format!("subject {subject:?} already exists in {whose} (subject ids are unique across tenants)"),
                ));
            }
            tx.insert_subject(subject, tenant)?;
            let evidence = json!({"tenant": tenant, "subject": subject});
            log_world_change(
                tx,
                now,
                operator,
                "subject_add",
                &format!("subject {subject} added to {tenant}"),
                &evidence,
            )?;
            Ok(())
        })
    }

    /// Disables (`enabled = false`) or enables again a tenant (`subject:
    /// None`: every subject of it) or one subject of it. A disabled
    /// principal's calls, status queries and accepted operations not yet sent
    /// are refused `SUBJECT_DISABLED` at their next authorization check; its
    /// grants, operations and operator log are kept (nothing that references
    /// it is deleted), so enabling it restores exactly what it had. Returns
    /// whether anything changed; a change is recorded in the operator log.
    /// Refused, changing nothing: `UNKNOWN_TENANT`, `UNKNOWN_SUBJECT`.
    pub fn set_enabled(
        &mut self,
        tenant: &str,
        subject: Option<&str>,
        enabled: bool,
        operator: &str,
    ) -> Result<bool, EngineError> {
        super::check_operator(operator)?;
        let now = self.clock.now_ms();
        self.store.write(|tx| -> Result<bool, EngineError> {
            if !tx.tenant_exists(tenant)? {
                return Err(EngineError::invalid("UNKNOWN_TENANT", "no such tenant"));
            }
            let (who, id) = match subject {
                None => (Principal::Tenant, tenant),
                Some(s) => {
                    if tx.subject_tenant(s)?.as_deref() != Some(tenant) {
                        return Err(EngineError::invalid("UNKNOWN_SUBJECT", "no such subject in that tenant"));
                    }
                    (Principal::Subject, s)
                }
            };
            let changed = tx.set_disabled(who, id, (!enabled).then_some(now))?;
            if changed {
                let verb = if enabled { "enable" } else { "disable" };
                let evidence = json!({"tenant": tenant, "subject": subject});
                let reason = format!("{} {id} {verb}d", who.as_str());
                log_world_change(tx, now, operator, &format!("{}_{verb}", who.as_str()), &reason, &evidence)?;
            }
            Ok(changed)
        })
    }

    /// Whether a tenant, or one subject of it, is disabled: since when
    /// (`None`: enabled). The subject's own mark, else its tenant's.
    pub fn disabled_since(&mut self, tenant: &str, subject: Option<&str>) -> Result<Option<i64>, EngineError> {
        Ok(self.store.read(|tx| -> Result<_, StoreError> {
            let own = match subject {
                Some(s) => tx.disabled_since(Principal::Subject, s)?,
                None => None,
            };
            Ok(own.or(tx.disabled_since(Principal::Tenant, tenant)?))
        })?)
    }
}

fn check_id(what: &str, id: &str) -> Result<(), EngineError> {
    if valid_id(id) {
        Ok(())
    } else {
        Err(bad(format!("{what} {id:?}: must be {ID_RULE}")))
    }
}

/// The operator log's entry for a change to the world (always applied: a
/// refused change is an error and writes nothing).
fn log_world_change(
    tx: &Tx<'_>,
    now: i64,
    operator: &str,
    action: &str,
    reason: &str,
    evidence: &serde_json::Value,
) -> Result<(), StoreError> {
    tx.insert_audit(&AuditRow {
        seq: 0,
        at: now,
        action_id: None,
        actor: operator.to_string(),
        action: action.to_string(),
        operation_id: None,
        approval_id: None,
        result: "applied".into(),
        reason: reason.to_string(),
        evidence: canonical_string(evidence),
        chain_sha256: None,
    })
}
