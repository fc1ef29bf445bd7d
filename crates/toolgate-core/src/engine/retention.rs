//! Retention: what is purged, when, and what is left of it.
//!
//! - A ledger row is kept while its operation is not terminal, and for the
//!   tool's retention after it became terminal (`terminal_at + retention_ms`);
//!   never counted from creation, so an operation that sat unknown for weeks and
//!   was settled today is kept for the whole retention from today.
//! - An operation a person acted on (an approval, a resolution, a cancel, an
//!   operator's status query: anything in the append-only audit log) is kept as
//!   long as its audit entries, that is for good.
//! - A purged operation leaves a tombstone (scope digest, final state, code,
//!   request and result digests, receipt id, when it ended, when and why it was
//!   purged), so the audit log and the trace still resolve its id.
//! - Purging is an explicit job (`toolgate reap`, or [`Engine::purge_expired`]);
//!   the console's and the workers' reaper passes never purge.
//! - After the purge the key stays taken: the tombstone keeps the scope digest,
//!   so a dispatch with the same scope is answered `IDEMPOTENCY_KEY_EXPIRED`
//!   with when the operation ended and how, never run a second time (a purge
//!   judged on a clock that ran ahead would otherwise turn a retry into a
//!   second refund). Tombstones are never purged: one is about 400 bytes with
//!   its index entries, so a million purged operations cost about 400 MB less
//!   than the ~9 KB each operation held before its purge.

use serde_json::json;

use super::canonical::{canonical_string, sha256_hex};
use super::{Engine, EngineError};
use crate::store::{OperationRow, TombstoneRow};

/// Rows purged per transaction: a long purge never holds the write lock long.
const PURGE_BATCH: i64 = 256;

/// What one purge pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PurgeReport {
    /// Terminal operations past their retention, purged (each left a tombstone).
    pub purged: usize,
    /// Terminal operations past their retention kept because a person acted on them.
    pub kept_for_audit: i64,
    /// Bytes given back to the file system after the purge (SQLite with
    /// incremental auto-vacuum).
    #[serde(skip_serializing_if = "is_zero")]
    pub bytes_reclaimed: u64,
    /// Stopped between batches (Ctrl-C): what is left waits for the next pass.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
    /// Why nothing was purged: the ledger's clock cannot be trusted here (see
    /// [`super::ledger_clock`]); a purge judged on a wrong clock deletes live rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_paused: Option<String>,
}

/// Pages given back per step after a purge (4 MiB at 4 KiB pages): each
/// step is one short write.
const RECLAIM_PAGES: u32 = 1024;

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// SHA-256 of the canonical `{tenant, subject, tool, idempotency_key}`: the
/// tombstone's record of the scope, without the key itself.
pub fn scope_sha256(tenant: &str, subject: &str, tool: &str, key: &str) -> String {
    let scope = json!({"tenant": tenant, "subject": subject, "tool": tool, "idempotency_key": key});
    sha256_hex(canonical_string(&scope).as_bytes())
}

fn tombstone_of(op: &OperationRow, now: i64) -> TombstoneRow {
    TombstoneRow {
        operation_id: op.id.clone(),
        scope_sha256: scope_sha256(&op.tenant, &op.subject, &op.tool, &op.idem_key),
        tool: op.tool.clone(),
        final_state: op.state.as_str().to_string(),
        code: op.code.clone(),
        request_sha256: op.request_sha256.clone(),
        result_sha256: op.result_sha256.clone(),
        receipt_id: op.receipt_id.clone(),
        created_at: op.created_at,
        terminal_at: op.terminal_at.unwrap_or(op.updated_at),
        purged_at: now,
        reason: "retention_ended".into(),
    }
}

impl Engine {
    /// Purges terminal operations whose retention has passed since they became
    /// terminal and that no person acted on, leaving a tombstone for each.
    pub fn purge_expired(&mut self) -> Result<PurgeReport, EngineError> {
        self.purge_expired_until(&std::sync::atomic::AtomicBool::new(false))
    }

    /// [`Engine::purge_expired`], stopping between batches once `stop` is set
    /// (`toolgate reap` on Ctrl-C). Each batch is its own short write
    /// transaction, chosen and deleted by index (schema 18), so writers wait
    /// at most one batch.
    pub fn purge_expired_until(&mut self, stop: &std::sync::atomic::AtomicBool) -> Result<PurgeReport, EngineError> {
        if let Some(why) = self.clock_check()? {
            return Ok(PurgeReport { clock_paused: Some(why), ..PurgeReport::default() });
        }
        let mut report = PurgeReport::default();
        loop {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                report.interrupted = true;
                break;
            }
            let now = self.clock.now_ms();
            let n = self.store.write(|tx| -> Result<usize, EngineError> {
                let mut n = 0;
                for op in tx.purgeable_operations(now, PURGE_BATCH)? {
                    if tx.purge_operation(&tombstone_of(&op, now))? {
                        n += 1;
                    }
                }
                Ok(n)
            })?;
            report.purged += n;
            if n < PURGE_BATCH as usize {
                break;
            }
        }
        // Space comes back in short steps (a SQLite ledger with incremental
        // auto-vacuum; nothing elsewhere), each its own write.
        if report.purged > 0 {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                // Best effort: the purge has committed; a busy database only
                // postpones giving space back to the next pass.
                match self.store.reclaim_space(RECLAIM_PAGES) {
                    Ok(0) => break,
                    Ok(freed) => report.bytes_reclaimed += freed,
                    Err(e) => {
                        tracing::warn!(error = %e, "giving space back after the purge stopped; the next pass goes on");
                        break;
                    }
                }
            }
        }
        let now = self.clock.now_ms();
        report.kept_for_audit = self.store.read(|tx| tx.count_kept_for_audit(now))?;
        Ok(report)
    }

    /// Rewrites a SQLite ledger into the least space and sets it to give
    /// space back after each purge from then on (`toolgate vacuum`; a
    /// ledger made before schema 18 needs it once). Returns (bytes before,
    /// bytes after). PostgreSQL: `DB_UNSUPPORTED`, its autovacuum does this.
    pub fn vacuum(&mut self) -> Result<(u64, u64), EngineError> {
        Ok(self.store.vacuum()?)
    }

    /// The tombstone of a purged operation, if it was purged.
    pub fn tombstone(&mut self, operation_id: &str) -> Result<Option<TombstoneRow>, EngineError> {
        Ok(self.store.read(|tx| tx.tombstone(operation_id))?)
    }

    /// The answer for an operation id that has no row: purged (with when and
    /// what it was), or unknown.
    pub(crate) fn missing_operation(&mut self, operation_id: &str) -> EngineError {
        match self.tombstone(operation_id) {
            Ok(Some(t)) => purged_error(&t),
            Ok(None) => EngineError::invalid("NO_SUCH_OPERATION", "no such operation"),
            Err(e) => e,
        }
    }
}

/// What a caller whose key's operation was purged is told: when it ran and how
/// it ended, and whether its request was this one.
pub(crate) fn expired_key_detail(t: &TombstoneRow, request_sha256: &str) -> serde_json::Value {
    json!({
        "operation_id": t.operation_id,
        "ended": t.final_state,
        "code": t.code,
        "ended_at": super::clock::rfc3339(t.terminal_at),
        "purged_at": super::clock::rfc3339(t.purged_at),
        "same_request": t.request_sha256 == request_sha256,
    })
}

/// `OPERATION_PURGED`: says when and what the operation was.
pub(crate) fn purged_error(t: &TombstoneRow) -> EngineError {
    EngineError::invalid(
        "OPERATION_PURGED",
        format!(
            "purged on {} ({}; it ended {} on {}; result digest {}, receipt {})",
            super::clock::rfc3339(t.purged_at),
            t.reason.replace('_', " "),
            t.final_state,
            super::clock::rfc3339(t.terminal_at),
            t.result_sha256.as_deref().unwrap_or("none"),
            t.receipt_id.as_deref().unwrap_or("none"),
        ),
    )
}
