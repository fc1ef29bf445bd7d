//! The idempotency scope: who called which tool under which key.

/// An idempotency scope: tenant, subject, tool and the key the ledger stores
/// (`operations.idem_key`). The ledger's unique key of an operation and of an
/// approval request, and, hashed, the business intent a downstream effect is
/// counted under. One value instead of four `&str`s in a row, which a call
/// site could swap without the compiler noticing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scope<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Subject (the caller).
    pub subject: &'a str,
    /// Tool.
    pub tool: &'a str,
    /// Idempotency key, as stored.
    pub key: &'a str,
}

impl<'a> Scope<'a> {
    /// A scope.
    pub fn new(tenant: &'a str, subject: &'a str, tool: &'a str, key: &'a str) -> Self {
        Self { tenant, subject, tool, key }
    }
}

impl super::OperationRow {
    /// The operation's scope.
    pub fn scope(&self) -> Scope<'_> {
        Scope::new(&self.tenant, &self.subject, &self.tool, &self.idem_key)
    }
}

impl super::ApprovalRow {
    /// The approval request's scope.
    pub fn scope(&self) -> Scope<'_> {
        Scope::new(&self.tenant, &self.subject, &self.tool, &self.idem_key)
    }
}
