//! Typed queries: holds (migration 0014), what an accepted operation has
//! reserved of a balance until it ends. The engine writes a hold in the
//! transaction that accepts the operation; [`Tx::update_operation`] deletes it
//! in the transaction that makes the operation terminal. A domain reads the
//! sum held on a resource to decide what is left.

use super::{params, Tx, R};

impl Tx<'_> {
    /// Holds `amount` of `resource` for an operation (in its accept's transaction).
    pub fn insert_hold(&self, operation_id: &str, resource: &str, amount: i64, now: i64) -> R<()> {
        self.conn
            .prepare_cached("INSERT INTO holds (operation_id, resource, amount, held_at) VALUES (?1, ?2, ?3, ?4)")?
            .execute(params![operation_id, resource, amount, now])?;
        Ok(())
    }

    /// What is held on `resource`, leaving out the hold of `except` (an
    /// operation re-checking its own rules counts what others hold).
    pub fn held_on(&self, resource: &str, except: Option<&str>) -> R<i64> {
        self.conn
            .prepare_cached(
                "SELECT CAST(coalesce(sum(amount), 0) AS BIGINT) FROM holds
                 WHERE resource = ?1 AND operation_id != coalesce(CAST(?2 AS TEXT), '')",
            )?
            .query_row(params![resource, except], |r| r.get(0))
    }

    /// The hold of one operation, if it has one: (resource, amount).
    pub fn hold_of(&self, operation_id: &str) -> R<Option<(String, i64)>> {
        self.conn
            .prepare_cached("SELECT resource, amount FROM holds WHERE operation_id = ?1")?
            .query_opt([operation_id], |r| Ok((r.get(0)?, r.get(1)?)))
    }

    /// Every hold: (operation id, resource, amount), by resource (audit, console).
    pub fn holds(&self) -> R<Vec<(String, String, i64)>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT operation_id, resource, amount FROM holds ORDER BY resource, operation_id")?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        rows.collect::<Result<_, _>>()
    }

    /// Ends the hold of an operation that became terminal (nothing when it had none).
    pub(super) fn release_hold(&self, operation_id: &str) -> R<()> {
        self.conn.prepare_cached("DELETE FROM holds WHERE operation_id = ?1")?.execute([operation_id])?;
        Ok(())
    }
}
