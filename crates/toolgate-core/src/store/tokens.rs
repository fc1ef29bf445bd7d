//! Typed queries for the API's bearer tokens (migration 0010, PostgreSQL 0002).
//! What a token is and how it is checked lives in `engine::tokens`; this file
//! only reads and writes the rows. The raw token is never a column: only the
//! digest of its secret part and its public prefix.

use super::sql::sql_text;
use serde::Serialize;

use super::rows::placeholders;
use super::sql::{params, Param, Row};
use super::{StoreError, Tx, R};

row! {
    /// One bearer token of the HTTP API: a subject's (tenant + subject) or an
    /// operator's. Never holds the token itself.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct TokenRow [TOKEN_COLS] {
        /// Token id (`tok_…`), what `token list` shows and `token revoke` takes.
        pub id: String,
        /// The public part of the token (`tgt_…`), shown in lists and used to find the row.
        pub prefix: String,
        /// SHA-256 of the secret part (never serialized).
        #[serde(skip)]
        pub secret_sha256: String,
        /// `subject` | `operator`.
        pub kind: String,
        /// The tenant a subject token acts in.
        pub tenant: Option<String>,
        /// The subject a subject token acts for.
        pub subject: Option<String>,
        /// The operator an operator token acts as.
        pub operator: Option<String>,
        /// A label the creator chose.
        pub name: Option<String>,
        /// Creation time (ms).
        pub created_at: i64,
        /// Expiry (ms, exclusive: at this instant it is expired), if any.
        pub expires_at: Option<i64>,
        /// Revocation time (ms), if revoked.
        pub revoked_at: Option<i64>,
        /// The tenants an operator token may act in, comma-separated; `None`
        /// for every tenant (and for subject tokens, scoped by `tenant`).
        pub operator_tenants: Option<String>,
    }
}

impl Tx<'_> {
    /// Stores a new token row.
    pub fn insert_token(&self, t: &TokenRow) -> R<()> {
        self.conn
            .prepare_cached(sql_text!(
                "INSERT INTO api_tokens ({TOKEN_COLS}) VALUES ({})",
                placeholders(TokenRow::WIDTH)
            ))?
            .execute(t.params().as_slice())?;
        Ok(())
    }

    /// The token whose public prefix this is (read at every request: a
    /// revocation is seen by the next one).
    pub fn token_by_prefix(&self, prefix: &str) -> R<Option<TokenRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {TOKEN_COLS} FROM api_tokens WHERE prefix = ?1"))?
            .query_opt([prefix], TokenRow::from_row)
    }

    /// Every token, newest first.
    pub fn tokens(&self) -> R<Vec<TokenRow>> {
        let mut st =
            self.conn.prepare_cached(sql_text!("SELECT {TOKEN_COLS} FROM api_tokens ORDER BY created_at DESC, id"))?;
        let rows = st.query_map((), TokenRow::from_row)?;
        rows.collect::<Result<_, StoreError>>()
    }

    /// Revokes a token. Returns whether a live token was revoked (false: no
    /// such token, or already revoked).
    pub fn revoke_token(&self, id: &str, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached("UPDATE api_tokens SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL")?
            .execute(params![id, now])?;
        Ok(n > 0)
    }

    /// A token by id.
    pub fn token(&self, id: &str) -> R<Option<TokenRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {TOKEN_COLS} FROM api_tokens WHERE id = ?1"))?
            .query_opt([id], TokenRow::from_row)
    }
}
