//! The demo domain's own table, `orders`, reached through the domain's view of
//! the step's transaction ([`DomainTx`]), never the ledger's `Tx`. Written once
//! for both backends, like the ledger's queries.
//!
//! The table itself is still created by the ledger's migrations (SQLite 0001
//! and 0014, PostgreSQL 0001 and 0005): applied migrations never change, and
//! ledgers written before the domain had a store of its own must open as they
//! are. Migrations owned by a domain are a step of their own.

use serde::Serialize;

use crate::store::{DomainRow, DomainTx, StoreError};

type R<T> = Result<T, StoreError>;

/// An order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OrderRow {
    /// Reference.
    pub order_ref: String,
    /// Tenant.
    pub tenant: String,
    /// Owner subject.
    pub owner: String,
    /// ISO currency.
    pub currency: String,
    /// Captured, minor units.
    pub captured_minor: i64,
    /// Refunded so far.
    pub refunded_minor: i64,
    /// `paid` | `partially_refunded` | `refunded`.
    pub status: String,
    /// Revision (bumped on every change).
    pub revision: i64,
    /// Money paid above the capture (minor units): refunds the provider
    /// committed past what the order had, kept instead of clipped (0 when
    /// all is well; the audit reports anything else).
    pub over_refunded_minor: i64,
}

/// The columns of [`OrderRow`], in field order.
macro_rules! order_cols {
    () => {
        "order_ref, tenant, owner, currency, captured_minor, refunded_minor, status, revision, over_refunded_minor"
    };
}

impl OrderRow {
    fn from_row(r: &DomainRow<'_, '_>) -> R<Self> {
        Ok(Self {
            order_ref: r.get(0)?,
            tenant: r.get(1)?,
            owner: r.get(2)?,
            currency: r.get(3)?,
            captured_minor: r.get(4)?,
            refunded_minor: r.get(5)?,
            status: r.get(6)?,
            revision: r.get(7)?,
            over_refunded_minor: r.get(8)?,
        })
    }
}

/// An order's status for what was refunded of its capture: the one rule the
/// world check, the audit, `raise_captures` and `revert_refund` use
/// (`apply_refund`'s SQL states the same in its CASE).
pub fn status_for(refunded_minor: i64, captured_minor: i64) -> &'static str {
    if refunded_minor == 0 {
        "paid"
    } else if refunded_minor >= captured_minor {
        "refunded"
    } else {
        "partially_refunded"
    }
}

/// Inserts an order (a world being loaded).
pub fn insert_order(tx: &DomainTx<'_, '_>, o: &OrderRow) -> R<()> {
    tx.execute(
        "INSERT INTO orders (order_ref, tenant, owner, currency, captured_minor, refunded_minor, status, revision)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        &[&o.order_ref, &o.tenant, &o.owner, &o.currency, &o.captured_minor, &o.refunded_minor, &o.status, &o.revision],
    )?;
    debug_assert_eq!(o.over_refunded_minor, 0, "a new order has paid nothing above its capture");
    Ok(())
}

/// An order.
pub fn order(tx: &DomainTx<'_, '_>, order_ref: &str) -> R<Option<OrderRow>> {
    tx.query_opt(
        concat!("SELECT ", order_cols!(), " FROM orders WHERE order_ref = ?1"),
        &[&order_ref],
        OrderRow::from_row,
    )
}

/// All orders, in order_ref order.
pub fn orders(tx: &DomainTx<'_, '_>) -> R<Vec<OrderRow>> {
    tx.query_all(concat!("SELECT ", order_cols!(), " FROM orders ORDER BY order_ref"), &[], OrderRow::from_row)
}

/// An order, locked for this transaction on PostgreSQL (`FOR UPDATE`):
/// transactions deciding from its balance queue behind each other (the
/// SERIALIZABLE conflict on what they read and hold keeps them correct
/// either way); on SQLite the write lock is already held.
pub fn order_for_update(tx: &DomainTx<'_, '_>, order_ref: &str) -> R<Option<OrderRow>> {
    if tx.backend() == crate::store::Backend::Postgres {
        return tx.query_opt(
            concat!("SELECT ", order_cols!(), " FROM orders WHERE order_ref = ?1 FOR UPDATE"),
            &[&order_ref],
            OrderRow::from_row,
        );
    }
    order(tx, order_ref)
}

/// Takes back a refund [`apply_refund`] recorded on wrong evidence: first
/// from what it recorded above the capture, then from the refunded total.
pub fn revert_refund(tx: &DomainTx<'_, '_>, order_ref: &str, amount: i64) -> R<()> {
    let Some(o) = order_for_update(tx, order_ref)? else { return Ok(()) };
    let from_over = amount.min(o.over_refunded_minor).max(0);
    let refunded = (o.refunded_minor - (amount - from_over)).max(0);
    let status = status_for(refunded, o.captured_minor);
    tx.execute(
        "UPDATE orders SET refunded_minor = ?2, over_refunded_minor = ?3, status = ?4, revision = revision + 1
         WHERE order_ref = ?1",
        &[&order_ref, &refunded, &(o.over_refunded_minor - from_over), &status],
    )?;
    Ok(())
}

/// Applies a committed refund to an order. Nothing is clipped: what would
/// take `refunded_minor` past the capture is added to `over_refunded_minor`
/// (money the provider paid that the order did not have), which the audit
/// reports.
pub fn apply_refund(tx: &DomainTx<'_, '_>, order_ref: &str, amount: i64) -> R<()> {
    tx.execute(
        "UPDATE orders SET
           over_refunded_minor = over_refunded_minor
             + CASE WHEN refunded_minor + ?2 > captured_minor THEN refunded_minor + ?2 - captured_minor ELSE 0 END,
           refunded_minor = CASE WHEN refunded_minor + ?2 > captured_minor THEN captured_minor
                                 ELSE refunded_minor + ?2 END,
           status = CASE WHEN refunded_minor + ?2 >= captured_minor THEN 'refunded' ELSE 'partially_refunded' END,
           revision = revision + 1
         WHERE order_ref = ?1",
        &[&order_ref, &amount],
    )?;
    Ok(())
}
