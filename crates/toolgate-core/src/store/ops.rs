//! Typed queries: Operations, their outbox rows and attempts, call identities and receipts: the aggregate every dispatch, worker, reaper and status query changes.

use super::sql::sql_text;
use std::fmt::Write as _;

use super::sql::{Param, Row};
use super::{
    params, placeholders, AttemptOutcome, AttemptRow, Backend, CallIdentityRow, CallKey, ForClaim, OpState,
    OperationRow, OutboxRow, OutboxState, ReceiptRow, Scope, TombstoneRow, Tx, Versioned, OP_COLS, OUTBOX_COLS, R,
    TOMBSTONE_COLS,
};

impl Tx<'_> {
    // ------------------------------------------------------ call identities

    /// A call identity's binding.
    pub fn call_identity(&self, k: &CallKey<'_>) -> R<Option<CallIdentityRow>> {
        self
            .conn
            .prepare_cached(
                "SELECT purpose, request_sha256, key_sha256, operation_id FROM call_identities
                 WHERE tenant = ?1 AND subject = ?2 AND provider = ?3 AND api_family = ?4 AND response_id = ?5 AND call_id = ?6",
            )?
            .query_opt(params![k.tenant, k.subject, k.provider, k.api_family, k.response_id, k.call_id], |r| {
                Ok(CallIdentityRow {
                    purpose: r.get(0)?,
                    request_sha256: r.get(1)?,
                    key_sha256: r.get(2)?,
                    operation_id: r.get(3)?,
                })
            })
    }

    /// Binds a call identity on first use (no-op if already bound).
    pub fn bind_call_identity(&self, k: &CallKey<'_>, row: &CallIdentityRow, now: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO call_identities
                   (tenant, subject, provider, api_family, response_id, call_id, purpose, request_sha256, key_sha256, operation_id, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                 ON CONFLICT (tenant, subject, provider, api_family, response_id, call_id)
                 DO UPDATE SET operation_id = coalesce(call_identities.operation_id, excluded.operation_id)",
            )?
            .execute(params![
                k.tenant,
                k.subject,
                k.provider,
                k.api_family,
                k.response_id,
                k.call_id,
                row.purpose,
                row.request_sha256,
                row.key_sha256,
                row.operation_id,
                now
            ])?;
        Ok(())
    }

    // ----------------------------------------------------------- operations

    /// The operation for a scope.
    pub fn operation_by_scope(&self, scope: Scope<'_>) -> R<Option<OperationRow>> {
        let Scope { tenant, subject, tool, key } = scope;
        self.conn
            .prepare_cached(sql_text!(
                "SELECT {OP_COLS} FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4"
            ))?
            .query_opt([tenant, subject, tool, key], OperationRow::from_row)
    }

    /// The state of the operation for a scope (no row: `None`).
    pub fn operation_state_by_scope(&self, scope: Scope<'_>) -> R<Option<String>> {
        let Scope { tenant, subject, tool, key } = scope;
        self.conn
            .prepare_cached(
                "SELECT state FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4",
            )?
            .query_opt([tenant, subject, tool, key], |r| r.get(0))
    }

    /// An operation by id.
    pub fn operation(&self, id: &str) -> R<Option<OperationRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {OP_COLS} FROM operations WHERE id = ?1"))?
            .query_opt([id], OperationRow::from_row)
    }

    /// An operation by status_ref.
    pub fn operation_by_status_ref(&self, status_ref: &str) -> R<Option<OperationRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {OP_COLS} FROM operations WHERE status_ref = ?1"))?
            .query_opt([status_ref], OperationRow::from_row)
    }

    /// Inserts a new operation (unique scope enforced by the schema).
    pub fn insert_operation(&self, o: &OperationRow) -> R<()> {
        self.conn
            .prepare_cached(sql_text!(
                "INSERT INTO operations ({OP_COLS}) VALUES ({})",
                placeholders(OperationRow::WIDTH)
            ))?
            .execute(o.params().as_slice())?;
        self.count_state(o.state, 1)
    }

    /// Adds `by` to the count of operations in `state` (SQLite; PostgreSQL's
    /// triggers keep its slotted counts, pg/0004). The store's own statement
    /// in the writer's transaction, not a trigger: migration 0013 says why.
    fn count_state(&self, state: OpState, by: i64) -> R<()> {
        if self.conn.backend() == Backend::Postgres {
            return Ok(());
        }
        self.conn
            .prepare_cached(
                "INSERT INTO state_counts (state, n) VALUES (?1, ?2) ON CONFLICT (state) DO UPDATE SET n = n + excluded.n",
            )?
            .execute(params![state, by])?;
        Ok(())
    }

    /// Writes back an operation, checking and bumping its version (optimistic
    /// fence: refused when the row changed since it was read). Returns false when
    /// the version did not match.
    ///
    /// Only the columns whose value changes are in the `SET` list: SQLite
    /// rewrites the entry of every index over a column it is told to set, even
    /// to the same value, and a dozen indexes cover this table. So the row's
    /// writable columns are read first (a primary-key lookup in the same
    /// transaction; the whole row would cost half of what this saves) and
    /// compared; the store keeps `state_since`, `terminal_at` and `expires_at`
    /// from them. PostgreSQL compares the values itself (an unchanged indexed
    /// column does not prevent a HOT update) and the read would be one more
    /// round trip, so there one statement sets them all.
    pub fn update_operation(&self, o: &OperationRow) -> R<Versioned> {
        if self.conn.backend() == Backend::Postgres {
            return self.update_operation_whole(o);
        }
        match self.writable(&o.id)? {
            Some(cur) => self.update_changed(&cur, o),
            None => Ok(Versioned::Stale),
        }
    }

    /// [`Tx::update_operation`] for a caller that holds the row exactly as
    /// this transaction read or inserted it (`stored`, changed by nothing
    /// since): the writable columns are compared with it instead of being
    /// read again. The version fence in the `UPDATE` still holds; debug builds
    /// (the tests) read the row all the same and check the caller's claim.
    pub fn update_operation_from(&self, stored: &OperationRow, o: &OperationRow) -> R<Versioned> {
        if self.conn.backend() == Backend::Postgres {
            return self.update_operation_whole(o);
        }
        let stored = Writable::of(stored);
        if cfg!(debug_assertions) {
            let cur = self.writable(&o.id)?;
            debug_assert_eq!(cur.as_ref(), Some(&stored), "update_operation_from: the stored row is not the ledger's");
        }
        self.update_changed(&stored, o)
    }

    /// The row's writable columns, by primary key.
    fn writable(&self, id: &str) -> R<Option<Writable>> {
        self.conn
            .prepare_cached(
                "SELECT version, state, code, result_json, result_sha256, downstream_request_id, receipt_id,
                   call_binding_sha256, approval_id, resolution, resolution_note, resolved_by, last_query_at,
                   last_query_result, updated_at, deadline_at, state_since, terminal_at, expires_at, retention_ms
                 FROM operations WHERE id = ?1",
            )?
            .query_opt([id], Writable::from_row)
    }

    /// Writes `o` over the stored columns `cur`, setting only those that change.
    fn update_changed(&self, cur: &Writable, o: &OperationRow) -> R<Versioned> {
        if cur.version != o.version {
            return Ok(Versioned::Stale);
        }
        // Time in state, and retention from the moment the operation becomes
        // terminal (the first time: a terminal row that changes keeps both).
        let state_since = if cur.state == o.state { cur.state_since } else { Some(o.updated_at) };
        let terminal_at = o.state.is_terminal().then(|| cur.terminal_at.unwrap_or(o.updated_at));
        let expires_at = if o.state.is_terminal() && cur.terminal_at.is_none() {
            o.updated_at + cur.retention_ms
        } else {
            cur.expires_at
        };
        let mut sql = String::from("UPDATE operations SET version = version + 1");
        let mut values: Vec<&dyn Param> = vec![&o.id, &o.version];
        macro_rules! set_changed {
            ($($column:ident: $new:expr),* $(,)?) => {$(
                if cur.$column != *$new {
                    values.push($new);
                    let _ = write!(sql, concat!(", ", stringify!($column), " = ?{}"), values.len());
                }
            )*};
        }
        set_changed! {
            state: &o.state,
            code: &o.code,
            result_json: &o.result_json,
            result_sha256: &o.result_sha256,
            downstream_request_id: &o.downstream_request_id,
            receipt_id: &o.receipt_id,
            call_binding_sha256: &o.call_binding_sha256,
            approval_id: &o.approval_id,
            resolution: &o.resolution,
            resolution_note: &o.resolution_note,
            resolved_by: &o.resolved_by,
            last_query_at: &o.last_query_at,
            last_query_result: &o.last_query_result,
            updated_at: &o.updated_at,
            deadline_at: &o.deadline_at,
            state_since: &state_since,
            terminal_at: &terminal_at,
            expires_at: &expires_at,
        }
        sql.push_str(" WHERE id = ?1 AND version = ?2");
        let n = self.conn.prepare_cached(&sql)?.execute(values.as_slice())?;
        if n != 1 {
            return Ok(Versioned::Stale);
        }
        if cur.state != o.state {
            self.count_state(cur.state, -1)?;
            self.count_state(o.state, 1)?;
            if o.state.is_terminal() {
                // Whatever it held is now refunded (the domain's local effect, in
                // this transaction) or released: it can no longer take effect.
                self.release_hold(&o.id)?;
            }
        }
        Ok(Versioned::Applied)
    }

    /// [`Tx::update_operation`] as one statement that sets every writable
    /// column, the lifecycle ones derived in SQL (PostgreSQL's form).
    fn update_operation_whole(&self, o: &OperationRow) -> R<Versioned> {
        let n = self.conn.prepare_cached(UPDATE_WHOLE)?.execute(params![
            o.id,
            o.state,
            o.code,
            o.result_json,
            o.result_sha256,
            o.downstream_request_id,
            o.receipt_id,
            o.call_binding_sha256,
            o.approval_id,
            o.resolution,
            o.resolution_note,
            o.resolved_by,
            o.last_query_at,
            o.last_query_result,
            o.updated_at,
            o.deadline_at,
            o.version
        ])?;
        if n != 1 {
            return Ok(Versioned::Stale);
        }
        if o.state.is_terminal() {
            self.release_hold(&o.id)?;
        }
        Ok(Versioned::Applied)
    }

    /// Operations, newest first, optionally by state, keyset-paged by (updated_at, id).
    pub fn list_operations(
        &self,
        state: Option<OpState>,
        limit: i64,
        before: Option<(i64, &str)>,
    ) -> R<Vec<OperationRow>> {
        let (b_at, b_id) = before.map_or((i64::MAX, ""), |(a, i)| (a, i));
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT {OP_COLS} FROM operations
             WHERE (CAST(?1 AS TEXT) IS NULL OR state = ?1) AND (updated_at < ?2 OR (updated_at = ?2 AND id < ?3) OR ?3 = '')
             ORDER BY updated_at DESC, id DESC LIMIT ?4"
        ))?;
        let rows = st.query_map(params![state, b_at, b_id, limit], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Unknown operations of one tool not asked since `asked_before` (never
    /// asked first, then the longest unasked; oldest first): what a worker
    /// settles by itself (`downstream.auto_query`).
    pub fn unknown_to_ask(&self, tool: &str, asked_before: i64, limit: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT id FROM operations
             WHERE state = 'unknown' AND tool = ?1 AND coalesce(last_query_at, 0) < ?2
             ORDER BY coalesce(last_query_at, 0), created_at, id LIMIT ?3",
        )?;
        let rows = st.query_map(params![tool, asked_before, limit], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Operations the ledger holds as having had no effect (failed, or
    /// resolved as failed by a person) although an attempt of theirs was sent:
    /// the ones whose provider the audit asks (the money check).
    pub fn sent_without_effect(&self) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT DISTINCT a.operation_id FROM attempts a JOIN operations o ON o.id = a.operation_id
             WHERE a.sent_at IS NOT NULL AND coalesce(a.outcome, '') NOT IN ('refused', 'not_sent')
               AND (o.state = 'failed' OR (o.state = 'resolved' AND o.resolution = 'failed'))
             ORDER BY a.operation_id",
        )?;
        let rows = st.query_map((), |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Every operation id (for the integrity audit).
    pub fn all_operations(&self) -> R<Vec<OperationRow>> {
        let mut st = self.conn.prepare_cached(sql_text!("SELECT {OP_COLS} FROM operations ORDER BY created_at, id"))?;
        let rows = st.query_map((), OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The operations under the same key string in other scopes (index
    /// `operations_key`): a new intent looks here for its own row when a hand
    /// edit moved that row out of its scope (tenant, subject or tool changed).
    pub fn operations_sharing_key(&self, scope: Scope<'_>) -> R<Vec<OperationRow>> {
        let Scope { tenant, subject, tool, key } = scope;
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT {OP_COLS} FROM operations
             WHERE idem_key = ?1 AND NOT (tenant = ?2 AND subject = ?3 AND tool = ?4) LIMIT 64"
        ))?;
        let rows = st.query_map(params![key, tenant, subject, tool], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operation counts per state.
    pub fn count_operations_by_state(&self) -> R<Vec<(String, i64)>> {
        // Kept by triggers (migration 0003): constant time on any ledger size.
        // Summed over PostgreSQL's slots (pg/0004), where one slot's count of
        // a state may be negative; SQLite has one row per state.
        let mut st = self.conn.prepare_cached(
            "SELECT state, CAST(sum(n) AS BIGINT) FROM state_counts GROUP BY state HAVING sum(n) > 0 ORDER BY state",
        )?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<_, _>>()
    }

    /// Terminal operations whose retention has passed (counted from the moment
    /// they became terminal) and that no person acted on (no audit-log entry,
    /// no approval): the only ones a purge may take. Oldest first, at most `limit`.
    pub fn purgeable_operations(&self, now: i64, limit: i64) -> R<Vec<OperationRow>> {
        let by_a_person = self.by_a_person();
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {OP_COLS} FROM operations o
             WHERE o.terminal_at IS NOT NULL AND o.expires_at <= ?1
               AND o.state IN ('succeeded', 'failed', 'resolved')
               AND o.approval_id IS NULL
               AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND {by_a_person})
             ORDER BY o.expires_at, o.id LIMIT ?2"
        ))?;
        let rows = st.query_map(params![now, limit], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Terminal operations past their retention that are kept because a person
    /// acted on them (they stay as long as their audit entries, which are never deleted).
    pub fn count_kept_for_audit(&self, now: i64) -> R<i64> {
        let by_a_person = self.by_a_person();
        self.conn
            .prepare_cached(&format!(
                "SELECT count(*) FROM operations o
                 WHERE o.terminal_at IS NOT NULL AND o.expires_at <= ?1
                   AND (o.approval_id IS NOT NULL
                        OR EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND {by_a_person}))"
            ))?
            .query_row([now], |r| r.get(0))
    }

    /// Purges one operation: writes its tombstone, then deletes its attempts,
    /// outbox row, receipts, call-identity bindings and the row itself. Returns
    /// false (and changes nothing) when the row is gone or no longer purgeable.
    #[must_use = "a purge may find the row no longer purgeable"]
    pub fn purge_operation(&self, t: &TombstoneRow) -> R<bool> {
        let still: Option<OpState> = self
            .conn
            .prepare_cached(
                "SELECT state FROM operations WHERE id = ?1 AND terminal_at IS NOT NULL AND expires_at <= ?2
                   AND state IN ('succeeded', 'failed', 'resolved')",
            )?
            .query_opt(params![t.operation_id, t.purged_at], |r| r.get(0))?;
        let Some(state) = still else {
            return Ok(false);
        };
        self.conn
            .prepare_cached(sql_text!(
                "INSERT INTO purged_operations ({TOMBSTONE_COLS}) VALUES ({})",
                placeholders(TombstoneRow::WIDTH)
            ))?
            .execute(t.params().as_slice())?;
        for table in ["attempts", "outbox", "receipts", "call_identities"] {
            self.conn
                .prepare_cached(&format!("DELETE FROM {table} WHERE operation_id = ?1"))?
                .execute([&t.operation_id])?;
        }
        self.conn.prepare_cached("DELETE FROM operations WHERE id = ?1")?.execute([&t.operation_id])?;
        self.count_state(state, -1)?;
        Ok(true)
    }

    /// The tombstone of a purged operation.
    pub fn tombstone(&self, operation_id: &str) -> R<Option<TombstoneRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {TOMBSTONE_COLS} FROM purged_operations WHERE operation_id = ?1"))?
            .query_opt([operation_id], TombstoneRow::from_row)
    }

    /// The newest tombstone of a scope, if its operation was purged.
    pub fn tombstone_by_scope(&self, scope_sha256: &str) -> R<Option<TombstoneRow>> {
        self.conn
            .prepare_cached(sql_text!(
                "SELECT {TOMBSTONE_COLS} FROM purged_operations WHERE scope_sha256 = ?1 ORDER BY purged_at DESC LIMIT 1"
            ))?
            .query_opt([scope_sha256], TombstoneRow::from_row)
    }

    // --------------------------------------------------------------- outbox

    /// Inserts the outbox row of a newly accepted operation.
    pub fn insert_outbox(&self, operation_id: &str, max_attempts: i64, available_at: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO outbox (operation_id, state, attempt, max_attempts, available_at) VALUES (?1, 'pending', 0, ?2, ?3)",
            )?
            .execute(params![operation_id, max_attempts, available_at])?;
        Ok(())
    }

    /// An outbox row.
    pub fn outbox(&self, operation_id: &str) -> R<Option<OutboxRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {OUTBOX_COLS} FROM outbox WHERE operation_id = ?1"))?
            .query_opt([operation_id], OutboxRow::from_row)
    }

    /// The outbox row a claim is about to take, locked for this transaction. On
    /// PostgreSQL `FOR UPDATE SKIP LOCKED`: a row another host's claim holds
    /// right now is not waited for; it reads as [`ForClaim::Busy`] and the
    /// worker moves on (the queue pattern: claimers never queue behind each
    /// other). On SQLite the write lock is already held: never busy.
    pub fn outbox_for_claim(&self, operation_id: &str) -> R<ForClaim> {
        if self.backend() == Backend::Postgres {
            let locked = self
                .conn
                .prepare_cached(sql_text!(
                    "SELECT {OUTBOX_COLS} FROM outbox WHERE operation_id = ?1 FOR UPDATE SKIP LOCKED"
                ))?
                .query_opt([operation_id], OutboxRow::from_row)?;
            if let Some(row) = locked {
                return Ok(ForClaim::Row(row));
            }
        }
        Ok(match self.outbox(operation_id)? {
            Some(_) if self.backend() == Backend::Postgres => ForClaim::Busy,
            Some(row) => ForClaim::Row(row),
            None => ForClaim::Missing,
        })
    }

    /// Claims a pending, due outbox row with a lease; bumps the attempt. Returns the
    /// new attempt number, or `None` when someone else holds it or it is not due.
    #[must_use = "a claim may lose to another worker"]
    pub fn claim(&self, operation_id: &str, owner: &str, now: i64, lease_until: i64) -> R<Option<i64>> {
        let attempt: Option<i64> = self
            .conn
            .prepare_cached(
                "UPDATE outbox SET state = 'leased', attempt = attempt + 1, lease_owner = ?2, lease_until = ?4
                 WHERE operation_id = ?1 AND state = 'pending' AND available_at <= ?3
                 RETURNING attempt",
            )?
            .query_opt(params![operation_id, owner, now, lease_until], |r| r.get(0))?;
        if let Some(a) = attempt {
            self.conn
                .prepare_cached(
                    "INSERT INTO attempts (operation_id, attempt, owner, claimed_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![operation_id, a, owner, now])?;
        }
        Ok(attempt)
    }

    /// Whether (owner, attempt) still holds the lease: the fence for every write a
    /// worker makes about its attempt.
    #[must_use = "the fence decides whether the worker may write"]
    pub fn holds_lease(&self, operation_id: &str, owner: &str, attempt: i64) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT 1 FROM outbox WHERE operation_id = ?1 AND state = 'leased' AND lease_owner = ?2 AND attempt = ?3",
            )?
            .query_opt(params![operation_id, owner, attempt], |_| Ok(()))?
            .is_some())
    }

    /// The sent-marker, fenced on (owner, attempt). Returns false when the fence fails.
    /// The fence is the statement's own condition (the lease as
    /// [`Tx::holds_lease`] reads it): one statement, not a read and a write.
    #[must_use = "the fence decides whether the attempt may be sent"]
    pub fn mark_sent(&self, operation_id: &str, owner: &str, attempt: i64, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE attempts SET sent_at = ?3
                 WHERE operation_id = ?1 AND attempt = ?2 AND sent_at IS NULL AND owner = ?4
                   AND EXISTS (SELECT 1 FROM outbox WHERE operation_id = ?1 AND state = 'leased'
                                 AND lease_owner = ?4 AND attempt = ?2)",
            )?
            .execute(params![operation_id, attempt, now, owner])?;
        Ok(n == 1)
    }

    /// Puts an outbox row back to pending, due at `available_at`.
    pub fn release_outbox(&self, operation_id: &str, available_at: i64, last_code: Option<&str>) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE outbox SET state = 'pending', lease_owner = NULL, lease_until = NULL, available_at = ?2,
                   last_code = coalesce(?3, last_code) WHERE operation_id = ?1",
            )?
            .execute(params![operation_id, available_at, last_code])?;
        Ok(())
    }

    /// Ends an outbox row: `done` (terminal) or `parked` (unknown: waits for a query or a human).
    pub fn close_outbox(&self, operation_id: &str, state: OutboxState, last_code: Option<&str>) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE outbox SET state = ?2, lease_owner = NULL, lease_until = NULL, last_code = coalesce(?3, last_code)
                 WHERE operation_id = ?1",
            )?
            .execute(params![operation_id, state, last_code])?;
        Ok(())
    }

    /// Records how an attempt ended.
    pub fn finish_attempt(
        &self,
        operation_id: &str,
        attempt: i64,
        outcome: AttemptOutcome,
        code: Option<&str>,
        now: i64,
    ) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE attempts SET outcome = ?3, code = ?4, finished_at = ?5 WHERE operation_id = ?1 AND attempt = ?2",
            )?
            .execute(params![operation_id, attempt, outcome, code, now])?;
        Ok(())
    }

    /// All attempts of an operation, in order.
    pub fn attempts(&self, operation_id: &str) -> R<Vec<AttemptRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT operation_id, attempt, owner, claimed_at, sent_at, finished_at, outcome, code
             FROM attempts WHERE operation_id = ?1 ORDER BY attempt",
        )?;
        let rows = st.query_map([operation_id], |r| {
            Ok(AttemptRow {
                operation_id: r.get(0)?,
                attempt: r.get(1)?,
                owner: r.get(2)?,
                claimed_at: r.get(3)?,
                sent_at: r.get(4)?,
                finished_at: r.get(5)?,
                outcome: r.get(6)?,
                code: r.get(7)?,
            })
        })?;
        rows.collect::<Result<_, _>>()
    }

    /// Pending outbox rows due by `due_by` whose operation deadline has not
    /// passed at `now`.
    pub fn ready_outbox(&self, now: i64, due_by: i64, limit: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT o.operation_id FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state = 'pending' AND o.available_at <= ?3 AND p.deadline_at > ?1
             ORDER BY o.available_at, o.operation_id LIMIT ?2",
        )?;
        let rows = st.query_map(params![now, limit, due_by], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Leases that have expired (`lease_until <= now`), and leases that end
    /// after `beyond`, further ahead than any lease is long (written on a clock
    /// that ran ahead): those are treated as expired too.
    pub fn expired_leases(&self, now: i64, beyond: i64) -> R<Vec<OutboxRow>> {
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT {OUTBOX_COLS} FROM outbox WHERE state = 'leased' AND (lease_until <= ?1 OR lease_until > ?2)"
        ))?;
        let rows = st.query_map([now, beyond], OutboxRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operations re-queued after a possibly-sent attempt (`in_flight` with a
    /// pending outbox row) whose deadline has passed: no worker will pick them up.
    pub fn overdue_in_flight(&self, now: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT o.operation_id FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state = 'pending' AND p.state = 'in_flight' AND p.deadline_at <= ?1
             ORDER BY o.operation_id",
        )?;
        let rows = st.query_map([now], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Outbox counts per state.
    pub fn count_outbox_by_state(&self) -> R<Vec<(String, i64)>> {
        let mut st = self.conn.prepare_cached("SELECT state, count(*) FROM outbox GROUP BY state ORDER BY state")?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<_, _>>()
    }

    // ------------------------------------------------------------- receipts

    /// Records a receipt the ledger has seen.
    pub fn insert_receipt(&self, r: &ReceiptRow) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO receipts (receipt_id, operation_id, request_id, body_sha256, result_sha256, source, recorded_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (receipt_id) DO NOTHING",
            )?
            .execute(params![r.receipt_id, r.operation_id, r.request_id, r.body_sha256, r.result_sha256, r.source, r.recorded_at])?;
        Ok(())
    }

    /// The operation a receipt is recorded for, if any.
    pub fn receipt_owner(&self, receipt_id: &str) -> R<Option<String>> {
        self.conn
            .prepare_cached("SELECT operation_id FROM receipts WHERE receipt_id = ?1")?
            .query_opt([receipt_id], |r| r.get(0))
    }

    /// Receipts whose operation does not exist or does not name them.
    pub fn orphan_receipts(&self) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT r.receipt_id FROM receipts r LEFT JOIN operations o ON o.id = r.operation_id
             WHERE o.id IS NULL OR o.receipt_id IS DISTINCT FROM r.receipt_id ORDER BY r.receipt_id",
        )?;
        let rows = st.query_map((), |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }
}

/// Every writable column of an operation, version-checked; retention counts
/// from the moment the operation first becomes terminal.
const UPDATE_WHOLE: &str = "UPDATE operations SET state = ?2, code = ?3, result_json = ?4, result_sha256 = ?5,
       downstream_request_id = ?6, receipt_id = ?7, call_binding_sha256 = ?8, approval_id = ?9,
       resolution = ?10, resolution_note = ?11, resolved_by = ?12, last_query_at = ?13,
       last_query_result = ?14, updated_at = ?15, deadline_at = ?16, version = version + 1,
       state_since = CASE WHEN state IS DISTINCT FROM ?2 THEN ?15 ELSE state_since END,
       terminal_at = CASE WHEN ?2 IN ('succeeded', 'failed', 'resolved') THEN coalesce(terminal_at, ?15) END,
       expires_at = CASE WHEN ?2 IN ('succeeded', 'failed', 'resolved') AND terminal_at IS NULL
                         THEN ?15 + retention_ms ELSE expires_at END
     WHERE id = ?1 AND version = ?17";

/// The columns [`Tx::update_operation`] may change, as stored, and what it
/// derives the lifecycle columns from.
#[derive(Debug, PartialEq)]
struct Writable {
    version: i64,
    state: OpState,
    code: Option<String>,
    result_json: Option<String>,
    result_sha256: Option<String>,
    downstream_request_id: Option<String>,
    receipt_id: Option<String>,
    call_binding_sha256: String,
    approval_id: Option<String>,
    resolution: Option<String>,
    resolution_note: Option<String>,
    resolved_by: Option<String>,
    last_query_at: Option<i64>,
    last_query_result: Option<String>,
    updated_at: i64,
    deadline_at: i64,
    state_since: Option<i64>,
    terminal_at: Option<i64>,
    expires_at: i64,
    retention_ms: i64,
}

impl Writable {
    /// The writable columns of a row the caller holds.
    fn of(o: &OperationRow) -> Self {
        Self {
            version: o.version,
            state: o.state,
            code: o.code.clone(),
            result_json: o.result_json.clone(),
            result_sha256: o.result_sha256.clone(),
            downstream_request_id: o.downstream_request_id.clone(),
            receipt_id: o.receipt_id.clone(),
            call_binding_sha256: o.call_binding_sha256.clone(),
            approval_id: o.approval_id.clone(),
            resolution: o.resolution.clone(),
            resolution_note: o.resolution_note.clone(),
            resolved_by: o.resolved_by.clone(),
            last_query_at: o.last_query_at,
            last_query_result: o.last_query_result.clone(),
            updated_at: o.updated_at,
            deadline_at: o.deadline_at,
            state_since: o.state_since,
            terminal_at: o.terminal_at,
            expires_at: o.expires_at,
            retention_ms: o.retention_ms,
        }
    }

    fn from_row(r: &Row<'_>) -> R<Self> {
        Ok(Self {
            version: r.get(0)?,
            state: r.get(1)?,
            code: r.get(2)?,
            result_json: r.get(3)?,
            result_sha256: r.get(4)?,
            downstream_request_id: r.get(5)?,
            receipt_id: r.get(6)?,
            call_binding_sha256: r.get(7)?,
            approval_id: r.get(8)?,
            resolution: r.get(9)?,
            resolution_note: r.get(10)?,
            resolved_by: r.get(11)?,
            last_query_at: r.get(12)?,
            last_query_result: r.get(13)?,
            updated_at: r.get(14)?,
            deadline_at: r.get(15)?,
            state_since: r.get(16)?,
            terminal_at: r.get(17)?,
            expires_at: r.get(18)?,
            retention_ms: r.get(19)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::{OpState, OpenOptions, OperationRow, Store, StoreError, Sync};

    const STATES: &[OpState] = OpState::ALL;

    fn row(id: &str) -> OperationRow {
        let digest = "0".repeat(64);
        OperationRow {
            id: id.into(),
            tenant: "t".into(),
            subject: "s".into(),
            tool: "create_refund".into(),
            idem_key: format!("key-{id}"),
            key_sha256: digest.clone(),
            request_sha256: digest.clone(),
            request_json: "{}".into(),
            input_rev: 1,
            output_rev: 1,
            effect_rev: 1,
            effect: "write".into(),
            state: OpState::Accepted,
            version: 1,
            status_ref: format!("sr-{id}"),
            downstream_key: format!("dk-{id}"),
            code: None,
            result_json: None,
            result_sha256: None,
            downstream_request_id: None,
            receipt_id: None,
            call_binding_sha256: digest,
            call_provider: "openai".into(),
            call_api_family: "responses".into(),
            call_response_id: format!("resp-{id}"),
            call_id: format!("call-{id}"),
            adapter_revision: "1".into(),
            approval_id: None,
            resolution: None,
            resolution_note: None,
            resolved_by: None,
            last_query_at: None,
            last_query_result: None,
            created_at: 1_000,
            updated_at: 1_000,
            deadline_at: 31_000,
            expires_at: 1_000 + 86_400_000,
            retention_ms: 86_400_000,
            terminal_at: None,
            state_since: Some(1_000),
        }
    }

    /// One change a caller may make before writing the row back.
    #[derive(Debug, Clone)]
    struct Change {
        state: usize,
        code: Option<u8>,
        result: Option<u8>,
        approval: Option<u8>,
        query: Option<u8>,
        advance_ms: i64,
        deadline_ms: i64,
        stale: bool,
    }

    fn change() -> impl Strategy<Value = Change> {
        (
            0..STATES.len(),
            proptest::option::of(0..3u8),
            proptest::option::of(0..3u8),
            proptest::option::of(0..2u8),
            proptest::option::of(0..2u8),
            prop_oneof![Just(0i64), 1..5_000i64],
            prop_oneof![Just(0i64), 1..5_000i64],
            proptest::bool::weighted(0.1),
        )
            .prop_map(|(state, code, result, approval, query, advance_ms, deadline_ms, stale)| Change {
                state,
                code,
                result,
                approval,
                query,
                advance_ms,
                deadline_ms,
                stale,
            })
    }

    fn apply(o: &mut OperationRow, c: &Change) {
        o.state = STATES[c.state];
        o.code = c.code.map(|n| format!("CODE_{n}"));
        o.result_json = c.result.map(|n| format!("{{\"n\":{n}}}"));
        o.result_sha256 = c.result.map(|n| format!("{n:064}"));
        o.receipt_id = c.result.map(|n| format!("rcpt_{n}"));
        o.downstream_request_id = c.result.map(|n| format!("dreq_{n}"));
        o.call_binding_sha256 = format!("{:064}", c.result.unwrap_or(9));
        o.approval_id = c.approval.map(|n| format!("apr_{n}"));
        o.resolution = c.approval.map(|n| ["succeeded", "compensated"][usize::from(n)].to_string());
        o.resolution_note = c.approval.map(|_| "a note".to_string());
        o.resolved_by = c.approval.map(|_| "operator".to_string());
        o.last_query_at = c.query.map(|n| i64::from(n) + o.updated_at);
        o.last_query_result = c.query.map(|n| format!("query_{n}"));
        o.updated_at += c.advance_ms;
        o.deadline_at += c.deadline_ms;
        if c.stale {
            o.version -= 1;
        }
    }

    /// A row as compared: what differs by construction (the ids) is blanked.
    fn comparable(mut o: OperationRow) -> OperationRow {
        let blank = row("x");
        o.id = blank.id;
        o.idem_key = blank.idem_key;
        o.status_ref = blank.status_ref;
        o.downstream_key = blank.downstream_key;
        o.call_response_id = blank.call_response_id;
        o.call_id = blank.call_id;
        o
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Setting only the changed columns (SQLite's form) leaves every row
        /// exactly as the one statement that sets them all (PostgreSQL's, and
        /// SQLite's before), lifecycle columns included, and a stale version
        /// changes nothing in either.
        #[test]
        fn writing_only_changed_columns_matches_the_full_update(changes in proptest::collection::vec(change(), 1..12)) {
            let dir = tempfile::tempdir().unwrap();
            let mut store = Store::open(&dir.path().join("u.db"), OpenOptions { create: true, sync: Sync::Normal }).unwrap();
            store.write(|tx| -> Result<(), StoreError> {
                tx.insert_tenant("t", 1_000)?;
                tx.insert_subject("s", "t")?;
                tx.insert_operation(&row("a"))?;
                tx.insert_operation(&row("b"))
            }).unwrap();
            for c in &changes {
                let (new, whole) = store.write(|tx| -> Result<_, StoreError> {
                    let mut a = tx.operation("a")?.unwrap();
                    let mut b = tx.operation("b")?.unwrap();
                    apply(&mut a, c);
                    apply(&mut b, c);
                    let new = tx.update_operation(&a)?;
                    let whole = tx.update_operation_whole(&b)?;
                    Ok((new, whole))
                }).unwrap();
                prop_assert_eq!(new.is_stale(), whole.is_stale());
                prop_assert_eq!(new.is_stale(), c.stale);
                let (a, b) = store.read(|tx| -> Result<_, StoreError> {
                    Ok((tx.operation("a")?.unwrap(), tx.operation("b")?.unwrap()))
                }).unwrap();
                prop_assert_eq!(comparable(a), comparable(b));
            }
        }
    }
}
