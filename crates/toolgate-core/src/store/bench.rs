//! The bare loops `toolgate bench` measures the engine against (`crate::bench`):
//! plain SQL doing the commits of one fresh `create_refund`, and one indexed
//! lookup, with no engine logic at all. Nothing else uses this module.
//!
//! The bare file is made by the ledger's own migrations (the same tables,
//! columns, constraints and indexes), then its triggers are dropped: the bare
//! loop is the floor, what SQLite and the disk need to persist the same rows,
//! and the rollups and counters the engine keeps (on SQLite by its own
//! statements, migration 0013; on PostgreSQL by triggers) are engine cost.
//! It stores the engine's own texts (request, result, trace fields), so rows
//! have the same size, and the same lifecycle columns (`state_since` on every
//! state change; `terminal_at` and the retention deadline `expires_at` when
//! the operation succeeds), which the console and the retention reaper need.
//! The keys callers and providers choose are scattered like real ones; the
//! bare loop's own operation ids are sequential (see `op_id`).
//!
//! One fresh write dispatch is three commits (see `engine::dispatch` and
//! ARCHITECTURE.md, "Which commits wait for the disk"), and the bare write
//! makes the same three, with the same rows, on two connections like the
//! engine's (the ledger's and the provider's):
//!
//! 1. accept, claim and sent-marker: operation + outbox + call identity +
//!    trace event; outbox lease + attempt + operation `in_flight` + trace
//!    event; attempt `sent_at` + trace event;
//! 2. the provider's own commit of the effect (its connection);
//! 3. persist: receipt + order + attempt + outbox + operation result + two trace events.
//!
//! A bare replay is the same lookup plus the one commit a replay cannot skip:
//! its answer recorded (call identity + trace event), not waiting for the disk.

use super::sql::sql_text;
use std::path::Path;

use super::sql::params;

use super::{OpenOptions, OperationRow, Store, StoreError, Sync, Tx, OP_COLS, R};

/// The texts a bare write stores: the engine's own, so rows have the same size.
#[derive(Debug, Clone)]
pub struct BarePayload {
    /// A canonical request, as the engine stores it.
    pub request_json: String,
    /// A canonical result.
    pub result_json: String,
    /// The trace events' `fields` of one fresh dispatch, in order (five).
    pub trace_fields: Vec<String>,
}

/// A bare ledger: the ledger's schema without its triggers, and two connections.
pub struct BareLedger {
    ledger: Store,
    provider: Store,
    payload: BarePayload,
}

impl std::fmt::Debug for BareLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BareLedger(..)")
    }
}

const TENANT: &str = "bare";
const SUBJECT: &str = "bare_agent";
const TOOL: &str = "create_refund";
const ORDER: &str = "ord_bare";
/// Stands for every SHA-256 column: 64 hex digits, like the real ones.
const DIGEST: &str = "5e0c7a1d9b3f42e8a6c1d0b9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9";

/// The bare loop's own ids are sequential: an engine may choose them so, and
/// then new rows land at the right edge of every index over the id (the
/// engine's are random, for operators to tell them apart: that cost is the
/// engine's).
fn op_id(n: u64) -> String {
    format!("op_bare{n:017}")
}

/// The keys others choose (the caller's idempotency key and call id, the
/// provider's request and receipt ids, the digest-derived downstream key and
/// status handle) are scattered as real ones are: sequential keys would put
/// every new entry on the same index page and understate the floor. A
/// bijection of `n` per kind (splitmix64's finalizer), so lookups by `n` work.
fn scatter(n: u64, kind: u64) -> u64 {
    let mut z = n ^ kind.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn idem_key(n: u64) -> String {
    format!("bench-bare-{:016x}", scatter(n, 1))
}

fn status_ref(n: u64) -> String {
    format!("sr1_bare{:056x}", scatter(n, 2))
}

fn downstream_key(n: u64) -> String {
    format!("dk_bare{:025x}", scatter(n, 3))
}

fn response_id(n: u64) -> String {
    format!("resp_bare{:023x}", scatter(n, 4))
}

fn call_id(n: u64) -> String {
    format!("call_bare{:023x}", scatter(n, 5))
}

fn request_id(n: u64) -> String {
    format!("dreq_bare{:016x}", scatter(n, 6))
}

fn receipt_id(n: u64) -> String {
    format!("rcpt_bare{:016x}", scatter(n, 7))
}

impl BareLedger {
    /// Creates the bare file at `path` (the ledger's migrations, then no
    /// triggers), with one tenant, subject and order, and opens the two
    /// connections with the engine's pragmas and durability.
    pub fn create(path: &Path, sync: Sync, payload: BarePayload) -> Result<Self, StoreError> {
        let mut ledger = Store::open(path, OpenOptions { create: true, sync })?;
        // The providers' tables (theirs, not the ledger's), then no trigger at all.
        drop(super::ProviderStore::open(path, OpenOptions { create: false, sync })?);
        let drops: Vec<String> = {
            let sql = match ledger.backend() {
                super::Backend::Sqlite => {
                    "SELECT 'DROP TRIGGER \"' || name || '\"' FROM sqlite_schema
                     WHERE type = 'trigger' AND tbl_name <> 'audit_log'"
                }
                super::Backend::Postgres => {
                    "SELECT 'DROP TRIGGER ' || t.tgname || ' ON ' || c.relname FROM pg_trigger t
                     JOIN pg_class c ON c.oid = t.tgrelid WHERE NOT t.tgisinternal AND c.relname <> 'audit_log'"
                }
            };
            let mut st = ledger.conn.prepare(sql)?;
            let rows = st.query_map((), |r| r.get(0))?;
            rows.collect::<Result<_, _>>()?
        };
        for d in drops {
            ledger.conn.execute(&d, ())?;
        }
        ledger.write(|tx| -> R<()> {
            tx.insert_tenant(TENANT, i64::MAX / 2)?;
            tx.insert_subject(SUBJECT, TENANT)?;
            // The demo domain's one order, as the engine's world load writes
            // it through the domain (the bare loop copies the rows the engine
            // and the demo domain commit; write 3 updates it below).
            tx.conn
                .prepare_cached(
                    "INSERT INTO orders (order_ref, tenant, owner, currency, captured_minor, refunded_minor, status, revision)
                     VALUES (?1, ?2, ?3, 'EUR', ?4, 0, 'paid', 1)",
                )?
                .execute(params![ORDER, TENANT, SUBJECT, i64::MAX / 2])?;
            Ok(())
        })?;
        let provider = Store::open(path, OpenOptions { create: false, sync })?;
        Ok(Self { ledger, provider, payload })
    }

    /// One fresh write, `n` never used before: the three commits of a dispatch.
    pub fn write_one(&mut self, n: u64, now: i64) -> R<()> {
        let id = op_id(n);
        let key = idem_key(n);
        let owner = "bench-bare-worker";
        let p = &self.payload;
        let field = |i: usize| p.trace_fields.get(i % p.trace_fields.len().max(1)).map_or("{}", String::as_str);
        // 1. accept
        self.ledger.write(|tx| -> R<()> {
            tx.conn
                .prepare_cached(
                    "INSERT INTO operations (id, tenant, subject, tool, idem_key, key_sha256, request_sha256,
                       request_json, input_rev, output_rev, effect_rev, effect, state, version, status_ref,
                       downstream_key, call_binding_sha256, call_provider, call_api_family, call_response_id,
                       call_id, adapter_revision, created_at, updated_at, deadline_at, expires_at, retention_ms, state_since)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, 1, 1, 1, 'write', 'accepted', 1, ?8, ?9, ?6,
                       'openai', 'responses', ?10, ?11, '1', ?12, ?12, CAST(?12 AS BIGINT) + 30000,
                       CAST(?12 AS BIGINT) + 2592000000, 2592000000, ?12)",
                )?
                .execute(params![
                    id,
                    TENANT,
                    SUBJECT,
                    TOOL,
                    key,
                    DIGEST,
                    p.request_json,
                    status_ref(n),
                    downstream_key(n),
                    response_id(n),
                    call_id(n),
                    now
                ])?;
            tx.conn
                .prepare_cached(
                    "INSERT INTO outbox (operation_id, state, attempt, max_attempts, available_at)
                     VALUES (?1, 'pending', 0, 5, ?2)",
                )?
                .execute(params![id, now])?;
            tx.conn
                .prepare_cached(
                    "INSERT INTO call_identities (tenant, subject, provider, api_family, response_id, call_id,
                       purpose, request_sha256, key_sha256, operation_id, created_at)
                     VALUES (?1, ?2, 'openai', 'responses', ?3, ?4, 'dispatch', ?5, ?5, ?6, ?7)",
                )?
                .execute(params![
                    TENANT,
                    SUBJECT,
                    response_id(n),
                    call_id(n),
                    DIGEST,
                    id,
                    now
                ])?;
            trace(tx, &id, "accepted", field(0), false, now)?;
            // the claim, in the same commit
            let attempt: i64 = tx
                .conn
                .prepare_cached(
                    "UPDATE outbox SET state = 'leased', attempt = attempt + 1, lease_owner = ?2, lease_until = ?3
                     WHERE operation_id = ?1 AND state = 'pending' RETURNING attempt",
                )?
                .query_row(params![id, owner, now + 6000], |r| r.get(0))?;
            tx.conn
                .prepare_cached(
                    "INSERT INTO attempts (operation_id, attempt, owner, claimed_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![id, attempt, owner, now])?;
            tx.conn
                .prepare_cached(
                    "UPDATE operations SET state = 'in_flight', updated_at = ?2, state_since = ?2, version = version + 1
                     WHERE id = ?1",
                )?
                .execute(params![id, now])?;
            trace(tx, &id, "claimed", field(1), false, now)?;
            // the sent-marker, in the same commit
            tx.conn
                .prepare_cached(
                    "UPDATE attempts SET sent_at = ?2 WHERE operation_id = ?1 AND attempt = 1 AND sent_at IS NULL",
                )?
                .execute(params![id, now])?;
            trace(tx, &id, "sent", field(2), false, now)
        })?;
        // 2. the provider's commit, on its own connection
        self.provider.write(|tx| -> R<()> {
            tx.conn
                .prepare_cached(
                    "INSERT INTO provider_effects (provider, downstream_key, intent, body_sha256, request_id,
                       receipt_id, result_json, committed_at, visible_at)
                     VALUES ('payments', ?1, ?2, ?2, ?3, ?4, ?5, ?6, ?6)",
                )?
                .execute(params![downstream_key(n), DIGEST, request_id(n), receipt_id(n), p.result_json, now])?;
            Ok(())
        })?;
        // 3. persist
        self.ledger.write(|tx| -> R<()> {
            tx.conn
                .prepare_cached(
                    "INSERT INTO receipts (receipt_id, operation_id, request_id, body_sha256, result_sha256, source,
                       recorded_at) VALUES (?1, ?2, ?3, ?4, ?4, 'reply', ?5)",
                )?
                .execute(params![receipt_id(n), id, request_id(n), DIGEST, now])?;
            tx.conn
                .prepare_cached(
                    "UPDATE orders SET refunded_minor = refunded_minor + 1, status = 'partially_refunded',
                       revision = revision + 1 WHERE order_ref = ?1",
                )?
                .execute([ORDER])?;
            tx.conn
                .prepare_cached(
                    "UPDATE attempts SET outcome = 'committed', finished_at = ?2 WHERE operation_id = ?1 AND attempt = 1",
                )?
                .execute(params![id, now])?;
            tx.conn
                .prepare_cached(
                    "UPDATE outbox SET state = 'done', lease_owner = NULL, lease_until = NULL WHERE operation_id = ?1",
                )?
                .execute([&id])?;
            tx.conn
                .prepare_cached(
                    "UPDATE operations SET state = 'succeeded', result_json = ?2, result_sha256 = ?3,
                       downstream_request_id = ?4, receipt_id = ?5, call_binding_sha256 = ?3, updated_at = ?6,
                       state_since = ?6, terminal_at = ?6, expires_at = CAST(?6 AS BIGINT) + retention_ms,
                       version = version + 1 WHERE id = ?1",
                )?
                .execute(params![
                    id,
                    p.result_json,
                    DIGEST,
                    request_id(n),
                    receipt_id(n),
                    now
                ])?;
            trace(tx, &id, "downstream_reply", field(3), false, now)?;
            trace(tx, &id, "persisted", field(4), true, now)
        })
    }

    /// One indexed lookup of the operation `write_one(n)` wrote, by its scope,
    /// decoded like the engine decodes it.
    pub fn lookup(&mut self, n: u64) -> R<Option<OperationRow>> {
        let key = idem_key(n);
        self.ledger.read(|tx| -> R<Option<OperationRow>> {
            tx
                .conn
                .prepare_cached(sql_text!(
                    "SELECT {OP_COLS} FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4"
                ))?
                .query_opt(params![TENANT, SUBJECT, TOOL, key], OperationRow::from_row)
        })
    }

    /// The least a replay must do: the same lookup, then record the answer (a
    /// call identity bound to the operation, one trace event) in one commit
    /// that, like the engine's, does not wait for the disk
    /// ([`Store::write_relaxed`]). `call` is a call id never used before.
    pub fn replay_one(&mut self, n: u64, call: u64, now: i64) -> R<Option<OperationRow>> {
        let key = idem_key(n);
        let fields = self.payload.trace_fields.last().map_or("{}", String::as_str);
        self.ledger.write_relaxed(|tx| -> R<Option<OperationRow>> {
            let op = tx
                .conn
                .prepare_cached(sql_text!(
                    "SELECT {OP_COLS} FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4"
                ))?
                .query_opt(params![TENANT, SUBJECT, TOOL, key], OperationRow::from_row)?;
            if let Some(op) = &op {
                tx.conn
                    .prepare_cached(
                        "INSERT INTO call_identities (tenant, subject, provider, api_family, response_id, call_id,
                           purpose, request_sha256, key_sha256, operation_id, created_at)
                         VALUES (?1, ?2, 'openai', 'responses', ?3, ?4, 'dispatch', ?5, ?5, ?6, ?7)",
                    )?
                    .execute(params![
                        TENANT,
                        SUBJECT,
                        format!("resp_replay{:021x}", scatter(call, 8)),
                        format!("call_replay{:021x}", scatter(call, 9)),
                        DIGEST,
                        op.id,
                        now
                    ])?;
                trace(tx, &op.id, "idempotency", fields, true, now)?;
            }
            Ok(op)
        })
    }
}

fn trace(tx: &Tx<'_>, op: &str, step: &str, fields: &str, answer: bool, now: i64) -> R<()> {
    tx.conn
        .prepare_cached(
            "INSERT INTO trace_events (at, operation_id, step, tool, code, outcome, delivery, attempt, duration_us,
               fields, answer, latency_us, tenant_ref, tool_version, timeout_stage, reason, latency_bucket_us)
             VALUES (?1, ?2, ?3, 'create_refund', NULL, ?4, ?5, 1, 100, ?6, ?7, ?8, 'tenant_5e0c7a1d9b3f42e8',
               '1.1.1', NULL, 'committed', ?8)",
        )?
        .execute(params![
            now,
            op,
            step,
            if answer { "committed" } else { "not_started" },
            answer.then_some("fresh"),
            fields,
            answer.then_some("dispatch"),
            answer.then_some(1000i64)
        ])?;
    Ok(())
}
