//! What a tool's domain may do inside the ledger transaction of the step that
//! asks ([`crate::engine::tool::ToolDomain`]): read the holds the engine keeps,
//! and run its own statements on its own tables. Not the ledger's [`Tx`]: a
//! domain cannot read or change operations, approvals or the trace, and the
//! engine stays free to change them.
//!
//! A domain's SQL lives in the domain's own store module (the demo domain's
//! is `toolgate-adapters`' `tools/demo/store.rs`), written once for both
//! backends like the ledger's (`?N` parameters, the SQL SQLite and PostgreSQL
//! share; [`DomainTx::backend`] for the few places they differ).

use super::sql::{Col, Param, Row};
use super::{Backend, StoreError, Tx};

type R<T> = Result<T, StoreError>;

/// A domain's view of the transaction it runs in (see the module docs).
#[derive(Clone, Copy)]
pub struct DomainTx<'t, 'c> {
    tx: &'t Tx<'c>,
}

/// A row of a domain's own query.
pub struct DomainRow<'r, 'a>(&'r Row<'a>);

impl DomainRow<'_, '_> {
    /// Column `i` (from 0) as an `i64`, `bool`, `String` or their `Option`s.
    pub fn get<T: Col>(&self, i: usize) -> R<T> {
        self.0.get(i)
    }
}

impl<'t, 'c> DomainTx<'t, 'c> {
    pub(crate) fn new(tx: &'t Tx<'c>) -> Self {
        Self { tx }
    }

    /// Which backend the transaction runs on.
    pub fn backend(&self) -> Backend {
        self.tx.backend()
    }

    /// What is held on `resource`, leaving out the hold of `except` (an
    /// operation re-checking its own rules counts what others hold).
    pub fn held_on(&self, resource: &str, except: Option<&str>) -> R<i64> {
        self.tx.held_on(resource, except)
    }

    /// The hold of one operation, if it has one: (resource, amount).
    pub fn hold_of(&self, operation_id: &str) -> R<Option<(String, i64)>> {
        self.tx.hold_of(operation_id)
    }

    /// Every hold: (operation id, resource, amount), by resource.
    pub fn holds(&self) -> R<Vec<(String, String, i64)>> {
        self.tx.holds()
    }

    /// Runs a statement on the domain's own tables; returns the rows changed.
    pub fn execute(&self, sql: &str, params: &[&dyn Param]) -> R<usize> {
        self.tx.conn.prepare_cached(sql)?.execute(params)
    }

    /// The first row of a query, mapped, or `None`.
    pub fn query_opt<T>(
        &self,
        sql: &str,
        params: &[&dyn Param],
        f: impl FnOnce(&DomainRow<'_, '_>) -> R<T>,
    ) -> R<Option<T>> {
        self.tx.conn.prepare_cached(sql)?.query_opt(params, |r| f(&DomainRow(r)))
    }

    /// Every row of a query, mapped.
    pub fn query_all<T>(
        &self,
        sql: &str,
        params: &[&dyn Param],
        mut f: impl FnMut(&DomainRow<'_, '_>) -> R<T>,
    ) -> R<Vec<T>> {
        self.tx.conn.prepare_cached(sql)?.query_map(params, |r| f(&DomainRow(r)))?.collect()
    }
}

impl<'c> Tx<'c> {
    /// This transaction as a domain sees it.
    pub fn domain(&self) -> DomainTx<'_, 'c> {
        DomainTx::new(self)
    }
}
