//! Typed queries: Approval requests.

use super::sql::sql_text;
use super::{params, placeholders, ApprovalRow, Tx, Versioned, APPROVAL_COLS, R};

impl Tx<'_> {
    // ------------------------------------------------------------ approvals

    /// Inserts an approval request.
    pub fn insert_approval(&self, a: &ApprovalRow) -> R<()> {
        self.conn
            .prepare_cached(sql_text!(
                "INSERT INTO approvals ({APPROVAL_COLS}) VALUES ({})",
                placeholders(ApprovalRow::WIDTH)
            ))?
            .execute(a.params().as_slice())?;
        Ok(())
    }

    /// An approval request.
    pub fn approval(&self, id: &str) -> R<Option<ApprovalRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {APPROVAL_COLS} FROM approvals WHERE id = ?1"))?
            .query_opt([id], ApprovalRow::from_row)
    }

    /// The newest approval request for a scope.
    pub fn latest_approval(&self, scope: super::Scope<'_>) -> R<Option<ApprovalRow>> {
        let super::Scope { tenant, subject, tool, key } = scope;
        self
            .conn
            .prepare_cached(sql_text!(
                "SELECT {APPROVAL_COLS} FROM approvals WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4
                 ORDER BY created_at DESC, rowid DESC LIMIT 1"
            ))?
            .query_opt([tenant, subject, tool, key], ApprovalRow::from_row)
    }

    /// Records a decision on an approval; only from `pending`. Returns whether it applied.
    pub fn decide_approval(&self, a: &ApprovalRow) -> R<Versioned> {
        let applied = self
            .conn
            .prepare_cached(
                "UPDATE approvals SET state = ?2, decided_by = ?3, decided_at = ?4, note = ?5, operation_id = ?6,
                   approval_sha256 = ?7 WHERE id = ?1 AND state = 'pending'",
            )?
            .execute(params![a.id, a.state, a.decided_by, a.decided_at, a.note, a.operation_id, a.approval_sha256])?
            == 1;
        Ok(if applied { Versioned::Applied } else { Versioned::Stale })
    }

    /// Pending approvals, soonest expiry first.
    pub fn pending_approvals(&self, limit: i64) -> R<Vec<ApprovalRow>> {
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT {APPROVAL_COLS} FROM approvals WHERE state = 'pending' ORDER BY expires_at, id LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }
}
