//! The database's own clock, for the ledger's one clock
//! (`engine::ledger_clock`), and the SQLite host's anchor.

use super::sql::Backend;
use super::{StoreError, Tx};

type R<T> = Result<T, StoreError>;

impl Tx<'_> {
    /// The database server's clock now, in ms since the epoch
    /// (`clock_timestamp()`, which moves within a transaction); `None` on
    /// SQLite, which has no server: its ledger time is the host's anchor.
    pub fn database_now_ms(&self) -> R<Option<i64>> {
        if self.backend() != Backend::Postgres {
            return Ok(None);
        }
        let ms: i64 = self
            .conn
            .prepare_cached("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")?
            .query_row((), |r| r.get(0))?;
        Ok(Some(ms))
    }
}
