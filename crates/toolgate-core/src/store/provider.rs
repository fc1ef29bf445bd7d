//! The simulated downstream providers' own storage. They stand for someone
//! else's system: the ledger's `Tx` cannot reach their tables, and they never
//! take part in a ledger transaction. A provider opens its own connection
//! ([`ProviderStore`]) and commits its effects in transactions of its own.
//!
//! Their tables are created by their own numbered migrations (`provider/`,
//! version in their own `provider_meta` table), never by the ledger's. They
//! sit in the ledger's database when the providers run in the engine's
//! process (one file, or one PostgreSQL database: a demo or a test is one
//! thing to copy), and in a database of their own under `toolgate provider
//! serve --db`. A SQLite ledger made before the providers had a
//! store of their own holds the same tables from its migrations 0001 and
//! 0003; the SQLite migration here is written to find and keep them.

use super::sql::sql_text;
use std::path::Path;

use super::rows::{EffectRow, EFFECT_COLS};
use super::sql::{params, Backend, Conn};
use super::{OpenOptions, Store, StoreError, Sync};

type R<T> = Result<T, StoreError>;

/// The providers' migrations, per backend, in order.
const SQLITE_MIGRATIONS: [&str; 3] = [
    include_str!("provider/sqlite_0001_effects.sql"),
    include_str!("provider/sqlite_0002_effect_counts_in_store.sql"),
    include_str!("provider/sqlite_0003_charges.sql"),
];
const PG_MIGRATIONS: [&str; 3] = [
    include_str!("provider/pg_0001_effects.sql"),
    include_str!("provider/pg_0002_effect_slots.sql"),
    include_str!("provider/pg_0003_charges.sql"),
];

/// Lock key that serializes the providers' migrations across processes (PostgreSQL).
const MIGRATION_LOCK: i64 = 0x7072_6f76_6964_6572; // "provider"

/// A connection to the simulated providers' tables.
#[derive(Debug)]
pub struct ProviderStore {
    store: Store,
}

impl ProviderStore {
    /// Opens the providers' storage in the database at `path` (a SQLite path or
    /// a PostgreSQL URL), creating the file when asked.
    pub fn open(path: &Path, opts: OpenOptions) -> R<Self> {
        let mut store = Store::open_unmigrated(path, opts, false)?;
        store.write(|tx| migrate(tx.conn))?;
        Ok(Self { store })
    }

    /// Opens it for reading only (a referee, a read-only engine); the
    /// providers' tables must be there already.
    pub fn open_read_only(path: &Path) -> R<Self> {
        let mut store = Store::open_unmigrated(path, OpenOptions::default(), true)?;
        let (version, supported) = store
            .read(|tx| -> R<(i64, i64)> { Ok((version(tx.conn)?, migrations(tx.conn.backend()).len() as i64)) })?;
        if version <= 0 {
            return Err(StoreError::NotToolgate);
        }
        if version > supported {
            return Err(StoreError::SchemaTooNew { found: version, supported });
        }
        if version < supported {
            return Err(StoreError::SchemaOld { found: version, supported });
        }
        Ok(Self { store })
    }

    /// The providers' own write transaction (the same retry rules as the ledger's).
    pub fn write<T, E: From<StoreError>>(
        &mut self,
        mut f: impl FnMut(&ProviderTx<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        self.store.write(|tx| f(&ProviderTx { conn: tx.conn }))
    }

    /// One consistent read.
    pub fn read<T, E: From<StoreError>>(&mut self, mut f: impl FnMut(&ProviderTx<'_>) -> Result<T, E>) -> Result<T, E> {
        self.store.read(|tx| f(&ProviderTx { conn: tx.conn }))
    }

    /// The durability it was opened with.
    pub fn durability(&self) -> Sync {
        self.store.durability()
    }
}

/// The providers' typed queries inside one of their transactions.
pub struct ProviderTx<'a> {
    conn: &'a Conn,
}

impl ProviderTx<'_> {
    /// The effect a provider committed under a downstream key (the first one).
    pub fn provider_effect_by_key(&self, provider: &str, downstream_key: &str) -> R<Option<EffectRow>> {
        self
            .conn
            .prepare_cached(sql_text!(
                "SELECT {EFFECT_COLS} FROM provider_effects WHERE provider = ?1 AND downstream_key = ?2 ORDER BY seq LIMIT 1"
            ))?
            .query_opt([provider, downstream_key], EffectRow::from_row)
    }

    /// Commits a provider effect.
    pub fn insert_provider_effect(&self, e: &EffectRow) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO provider_effects (provider, downstream_key, intent, body_sha256, request_id, receipt_id, result_json, committed_at, visible_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?
            .execute(params![
                e.provider,
                e.downstream_key,
                e.intent,
                e.body_sha256,
                e.request_id,
                e.receipt_id,
                e.result_json,
                e.committed_at,
                e.visible_at
            ])?;
        self.count_effect(&e.intent)
    }

    /// Counts a committed effect (SQLite; PostgreSQL's trigger does it,
    /// pg_0002): one more for its intent, and a duplicate when the intent now
    /// has two (a third is the same duplicate). In the statements of the
    /// insert's own transaction, not a trigger: see sqlite_0002.
    fn count_effect(&self, intent: &str) -> R<()> {
        if self.conn.backend() == Backend::Postgres {
            return Ok(());
        }
        let now: i64 = self
            .conn
            .prepare_cached(
                "INSERT INTO intent_effects (intent, n) VALUES (?1, 1)
                 ON CONFLICT (intent) DO UPDATE SET n = n + 1 RETURNING n",
            )?
            .query_row([intent], |r| r.get(0))?;
        self.conn
            .prepare_cached(
                "UPDATE effect_totals SET effects = effects + 1, duplicates = duplicates + (?1 = 2) WHERE id = 1",
            )?
            .execute(params![now])?;
        Ok(())
    }

    /// What a provider paid out per order (the `order_ref` and `amount_minor`
    /// of each effect's result), for the load referee's money check.
    pub fn paid_by_order(&self, provider: &str) -> R<std::collections::BTreeMap<String, i64>> {
        let mut st = self.conn.prepare_cached("SELECT result_json FROM provider_effects WHERE provider = ?1")?;
        let rows: Vec<String> = st.query_map([provider], |r| r.get(0))?.collect::<Result<_, _>>()?;
        let mut paid = std::collections::BTreeMap::new();
        for r in rows {
            let v: serde_json::Value = serde_json::from_str(&r).unwrap_or_default();
            if let (Some(o), Some(a)) = (
                v.get("order_ref").and_then(serde_json::Value::as_str),
                v.get("amount_minor").and_then(serde_json::Value::as_i64),
            ) {
                *paid.entry(o.to_string()).or_default() += a;
            }
        }
        Ok(paid)
    }

    /// Records a charge the provider captured (once: a charge it knows stays as it is).
    pub fn insert_charge(
        &self,
        provider: &str,
        order_ref: &str,
        currency: &str,
        captured_minor: i64,
        refunded_minor: i64,
    ) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO provider_charges (provider, order_ref, currency, captured_minor, refunded_minor)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (provider, order_ref) DO NOTHING",
            )?
            .execute(params![provider, order_ref, currency, captured_minor, refunded_minor])?;
        Ok(())
    }

    /// Takes `amount` from what remains of a charge, atomically (a conditional
    /// update: two refunds at once cannot both take the last of it).
    /// `None` when the provider holds no charge for the order; `Some(false)`
    /// when the charge does not cover the amount (nothing changes).
    pub fn take_from_charge(&self, provider: &str, order_ref: &str, amount: i64) -> R<Option<bool>> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE provider_charges SET refunded_minor = refunded_minor + ?3
                 WHERE provider = ?1 AND order_ref = ?2 AND refunded_minor + ?3 <= captured_minor",
            )?
            .execute(params![provider, order_ref, amount])?;
        if n == 1 {
            return Ok(Some(true));
        }
        let known = self
            .conn
            .prepare_cached("SELECT 1 FROM provider_charges WHERE provider = ?1 AND order_ref = ?2")?
            .query_opt([provider, order_ref], |_| Ok(()))?;
        Ok(known.map(|()| false))
    }

    /// Moves every effect's visibility `ms` earlier: what the passing of `ms`
    /// looks like to a lookup, for a provider whose clock cannot be moved (a
    /// served provider keeps real time; a scenario's clock is manual).
    pub fn shift_visibility(&self, ms: i64) -> R<()> {
        self.conn.prepare_cached("UPDATE provider_effects SET visible_at = visible_at - ?1")?.execute(params![ms])?;
        Ok(())
    }

    /// One provider's committed effects and its business intents with more
    /// than one of them (`toolgate counts`, per downstream). A scan of its
    /// effects, unlike the totals the console reads at every refresh.
    pub fn effect_counts_of(&self, provider: &str) -> R<(i64, i64)> {
        self.conn
            .prepare_cached(
                "SELECT CAST(coalesce(sum(n), 0) AS BIGINT), CAST(coalesce(sum(CASE WHEN n > 1 THEN 1 ELSE 0 END), 0) AS BIGINT)
                 FROM (SELECT intent, count(*) AS n FROM provider_effects WHERE provider = ?1 GROUP BY intent) per_intent",
            )?
            .query_row([provider], |r| Ok((r.get(0)?, r.get(1)?)))
    }

    /// Total committed provider effects.
    pub fn count_effects(&self) -> R<i64> {
        // Summed over slots (PostgreSQL's provider migration 0002; SQLite has one row).
        self.conn
            .prepare_cached("SELECT CAST(coalesce(sum(effects), 0) AS BIGINT) FROM effect_totals WHERE id = 1")?
            .query_row((), |r| r.get(0))
    }

    /// Effects committed for one business intent.
    pub fn count_effects_for_intent(&self, intent: &str) -> R<i64> {
        self.conn
            .prepare_cached("SELECT count(*) FROM provider_effects WHERE intent = ?1")?
            .query_row([intent], |r| r.get(0))
    }

    /// Intents with more than one committed effect (must be 0 outside lab mode).
    pub fn side_effect_duplicates(&self) -> R<i64> {
        self.conn
            .prepare_cached("SELECT CAST(coalesce(sum(duplicates), 0) AS BIGINT) FROM effect_totals WHERE id = 1")?
            .query_row((), |r| r.get(0))
    }
}

fn migrations(backend: Backend) -> &'static [&'static str] {
    match backend {
        Backend::Sqlite => &SQLITE_MIGRATIONS,
        Backend::Postgres => &PG_MIGRATIONS,
    }
}

/// The providers' schema version: 0 when their tables are not there yet.
fn version(conn: &Conn) -> R<i64> {
    let has_meta = match conn.backend() {
        Backend::Sqlite => conn
            .prepare("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'provider_meta'")?
            .query_row((), |r| r.get::<i64>(0))?,
        Backend::Postgres => conn
            .prepare("SELECT CASE WHEN to_regclass('provider_meta') IS NULL THEN 0 ELSE 1 END")?
            .query_row((), |r| r.get::<i64>(0))?,
    };
    if has_meta == 0 {
        // A SQLite ledger from before the providers had a store of their own
        // holds their tables from its own migrations: that is version 1.
        if conn.backend() == Backend::Sqlite {
            let legacy = conn
                .prepare("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'provider_effects'")?
                .query_row((), |r| r.get::<i64>(0))?;
            return Ok(legacy.min(1));
        }
        return Ok(0);
    }
    let v: Option<String> = conn
        .prepare_cached("SELECT value FROM provider_meta WHERE key = 'schema_version'")?
        .query_opt((), |r| r.get(0))?;
    Ok(v.and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// Applies the providers' migrations not applied yet, in the caller's write
/// transaction (one migrator at a time: SQLite's write lock, PostgreSQL's
/// advisory lock).
fn migrate(conn: &Conn) -> R<()> {
    if conn.backend() == Backend::Postgres {
        conn.execute("SELECT pg_advisory_xact_lock(?1)", params![MIGRATION_LOCK])?;
    }
    let all = migrations(conn.backend());
    let from = version(conn)?;
    if from > all.len() as i64 {
        return Err(StoreError::SchemaTooNew { found: from, supported: all.len() as i64 });
    }
    if from == all.len() as i64 {
        return Ok(());
    }
    conn.execute_batch("CREATE TABLE IF NOT EXISTS provider_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")?;
    for (i, sql) in all.iter().enumerate().skip(from as usize) {
        conn.execute_batch(sql).map_err(|e| match e {
            StoreError::Other(reason) | StoreError::Constraint(reason) => {
                StoreError::Migration { number: i + 1, found: from, reason }
            }
            other => other,
        })?;
    }
    conn.execute(
        "INSERT INTO provider_meta (key, value) VALUES ('schema_version', ?1)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        params![all.len().to_string()],
    )?;
    Ok(())
}
