//! The simulated downstream providers' own storage. They stand for someone
//! else's system: the ledger's `Tx` cannot reach their tables, and they never
//! take part in a ledger transaction. A provider opens its own connection
//! ([`ProviderStore`]) and commits its effects in transactions of its own.
//!
//! Their tables sit in the same database as the ledger (one file, or one
//! PostgreSQL database), so that a demo or a test is one thing to copy, and
//! `toolgate provider serve --provider-db` gives them a file of their own.

use std::path::Path;

use super::rows::{EffectRow, EFFECT_COLS};
use super::sql::{params, Conn};
use super::{OpenOptions, Store, StoreError, Sync};

type R<T> = Result<T, StoreError>;

/// A connection to the simulated providers' tables.
#[derive(Debug)]
pub struct ProviderStore {
    store: Store,
}

impl ProviderStore {
    /// Opens the providers' storage in the database at `path` (a SQLite path or
    /// a PostgreSQL URL), creating the file when asked.
    pub fn open(path: &Path, opts: OpenOptions) -> R<Self> {
        Ok(Self { store: Store::open(path, opts)? })
    }

    /// Opens it for reading only (a referee, a read-only engine).
    pub fn open_read_only(path: &Path) -> R<Self> {
        Ok(Self { store: Store::open_read_only(path)? })
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
            .prepare_cached(&format!(
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
        Ok(())
    }

    /// Total committed provider effects.
    pub fn count_effects(&self) -> R<i64> {
        self.conn.prepare_cached("SELECT effects FROM effect_totals WHERE id = 1")?.query_row((), |r| r.get(0))
    }

    /// Effects committed for one business intent.
    pub fn count_effects_for_intent(&self, intent: &str) -> R<i64> {
        self.conn
            .prepare_cached("SELECT count(*) FROM provider_effects WHERE intent = ?1")?
            .query_row([intent], |r| r.get(0))
    }

    /// Intents with more than one committed effect (must be 0 outside lab mode).
    pub fn side_effect_duplicates(&self) -> R<i64> {
        self.conn.prepare_cached("SELECT duplicates FROM effect_totals WHERE id = 1")?.query_row((), |r| r.get(0))
    }
}
