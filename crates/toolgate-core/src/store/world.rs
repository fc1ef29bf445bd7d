//! Typed queries: the world and grants (tenants, subjects, approvers, grants) and the ledger's meta rows. (A domain's own records, like the demo's orders, are its store's.)

use super::{params, StoreError, TenantRow, Tx, R};

/// Which kind of principal a disable mark names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Principal {
    /// A tenant: every subject of it.
    Tenant,
    /// One subject.
    Subject,
}

impl Principal {
    /// The stable name, as in the meta key and the operator log.
    pub fn as_str(self) -> &'static str {
        match self {
            Principal::Tenant => "tenant",
            Principal::Subject => "subject",
        }
    }
}

/// What [`Tx::access`] found for a (tenant, subject, tool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// An active grant, and neither the subject nor its tenant is disabled.
    Granted,
    /// No active grant.
    NotGranted,
    /// The subject or its tenant is disabled (whatever its grants).
    Disabled,
}

fn disabled_key(who: Principal, id: &str) -> String {
    format!("disabled:{}:{id}", who.as_str())
}

impl Tx<'_> {
    // ---------------------------------------------------------------- meta

    /// A meta value.
    pub fn meta(&self, key: &str) -> R<Option<String>> {
        self.conn.prepare_cached("SELECT value FROM meta WHERE key = ?1")?.query_opt([key], |r| r.get(0))
    }

    /// Sets a meta value if absent; returns the stored value.
    pub fn meta_init(&self, key: &str, value: &str) -> R<String> {
        self.conn
            .prepare_cached("INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO NOTHING")?
            .execute([key, value])?;
        Ok(self.meta(key)?.unwrap_or_default())
    }

    /// Sets a meta value.
    pub fn meta_set(&self, key: &str, value: &str) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            )?
            .execute([key, value])?;
        Ok(())
    }

    // --------------------------------------------------------------- world

    /// Inserts a tenant.
    pub fn insert_tenant(&self, id: &str, threshold: i64) -> R<()> {
        self.conn
            .prepare_cached("INSERT INTO tenants (id, approval_threshold_minor) VALUES (?1, ?2)")?
            .execute(params![id, threshold])?;
        Ok(())
    }

    /// Adds an approver to a tenant's allowlist.
    pub fn insert_approver(&self, tenant: &str, approver: &str) -> R<()> {
        self.conn
            .prepare_cached("INSERT INTO approvers (tenant, approver) VALUES (?1, ?2)")?
            .execute([tenant, approver])?;
        Ok(())
    }

    /// Inserts a subject.
    pub fn insert_subject(&self, id: &str, tenant: &str) -> R<()> {
        self.conn.prepare_cached("INSERT INTO subjects (id, tenant) VALUES (?1, ?2)")?.execute([id, tenant])?;
        Ok(())
    }

    /// Grants a tool (re-granting clears `revoked_at`). Returns whether anything changed.
    pub fn grant(&self, tenant: &str, subject: &str, tool: &str, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached(
                "INSERT INTO grants (tenant, subject, tool, granted_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (tenant, subject, tool) DO UPDATE SET granted_at = excluded.granted_at, revoked_at = NULL
                 WHERE grants.revoked_at IS NOT NULL",
            )?
            .execute(params![tenant, subject, tool, now])?;
        Ok(n > 0)
    }

    /// Revokes a grant. Returns whether an active grant was revoked.
    pub fn revoke(&self, tenant: &str, subject: &str, tool: &str, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE grants SET revoked_at = ?4 WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND revoked_at IS NULL",
            )?
            .execute(params![tenant, subject, tool, now])?;
        Ok(n > 0)
    }

    /// The tenant a subject acts for.
    pub fn subject_tenant(&self, subject: &str) -> R<Option<String>> {
        self.conn.prepare_cached("SELECT tenant FROM subjects WHERE id = ?1")?.query_opt([subject], |r| r.get(0))
    }

    /// Whether a subject of `tenant` may call `tool`, read now (never
    /// cached), in one statement: an unrevoked grant joined to the subject's
    /// own row (a grant row naming another tenant's subject does not count),
    /// and the disable marks of the subject and of its tenant.
    pub fn access(&self, tenant: &str, subject: &str, tool: &str) -> R<Access> {
        let mut st = self.conn.prepare_cached(
            "SELECT g.tool FROM grants g JOIN subjects s ON s.id = g.subject AND s.tenant = g.tenant
             WHERE g.tenant = ?1 AND g.subject = ?2 AND g.tool = ?3 AND g.revoked_at IS NULL
             UNION ALL SELECT key FROM meta WHERE key IN (?4, ?5)",
        )?;
        let (tk, sk) = (disabled_key(Principal::Tenant, tenant), disabled_key(Principal::Subject, subject));
        let rows: Vec<String> =
            st.query_map([tenant, subject, tool, tk.as_str(), sk.as_str()], |r| r.get(0))?.collect::<R<_>>()?;
        Ok(if rows.iter().any(|k| *k == tk || *k == sk) {
            Access::Disabled
        } else if rows.is_empty() {
            Access::NotGranted
        } else {
            Access::Granted
        })
    }

    /// Every tool a subject of `tenant` may call (the same rule as
    /// [`Tx::access`], in one statement): none while it or its tenant is disabled.
    pub fn granted_tools(&self, tenant: &str, subject: &str) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT g.tool FROM grants g JOIN subjects s ON s.id = g.subject AND s.tenant = g.tenant
             WHERE g.tenant = ?1 AND g.subject = ?2 AND g.revoked_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM meta WHERE key IN (?3, ?4))
             ORDER BY g.tool",
        )?;
        let (tk, sk) = (disabled_key(Principal::Tenant, tenant), disabled_key(Principal::Subject, subject));
        let rows = st.query_map([tenant, subject, tk.as_str(), sk.as_str()], |r| r.get(0))?;
        rows.collect::<Result<_, StoreError>>()
    }

    /// Marks a tenant or subject disabled (`Some(since)`) or enabled again
    /// (`None`). Returns whether anything changed. The mark is a meta row
    /// (`disabled:tenant:ID`, `disabled:subject:ID`, its value the time it was
    /// set): no column of the world's tables holds it.
    pub fn set_disabled(&self, who: Principal, id: &str, since: Option<i64>) -> R<bool> {
        let key = disabled_key(who, id);
        let n = match since {
            Some(at) => self
                .conn
                .prepare_cached("INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO NOTHING")?
                .execute(params![key, at.to_string()])?,
            None => self.conn.prepare_cached("DELETE FROM meta WHERE key = ?1")?.execute([key.as_str()])?,
        };
        Ok(n > 0)
    }

    /// Since when a tenant or subject is disabled (`None`: it is not).
    pub fn disabled_since(&self, who: Principal, id: &str) -> R<Option<i64>> {
        Ok(self.meta(&disabled_key(who, id))?.and_then(|v| v.parse().ok()))
    }

    /// Whether a tenant exists.
    pub fn tenant_exists(&self, id: &str) -> R<bool> {
        Ok(self.conn.prepare_cached("SELECT 1 FROM tenants WHERE id = ?1")?.query_opt([id], |_| Ok(()))?.is_some())
    }

    /// A tenant.
    pub fn tenant(&self, id: &str) -> R<Option<TenantRow>> {
        self.conn
            .prepare_cached("SELECT id, approval_threshold_minor, policy_revision FROM tenants WHERE id = ?1")?
            .query_opt([id], |r| {
                Ok(TenantRow { id: r.get(0)?, approval_threshold_minor: r.get(1)?, policy_revision: r.get(2)? })
            })
    }

    /// Bumps a tenant's policy revision (invalidates pending approvals).
    pub fn bump_policy_revision(&self, tenant: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached("UPDATE tenants SET policy_revision = policy_revision + 1 WHERE id = ?1")?
            .execute([tenant])?
            > 0)
    }

    /// Whether `approver` is on the tenant's allowlist.
    pub fn is_approver(&self, tenant: &str, approver: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached("SELECT 1 FROM approvers WHERE tenant = ?1 AND approver = ?2")?
            .query_opt([tenant, approver], |_| Ok(()))?
            .is_some())
    }
}
