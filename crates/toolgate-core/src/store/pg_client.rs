//! A blocking PostgreSQL client whose every round trip is bounded.
//!
//! Written by hand, small on purpose: the `postgres` crate's blocking client
//! (tokio-postgres driven on a current-thread runtime) has no per-statement
//! timeout, so a connection whose packets are acknowledged but never
//! delivered (a hung proxy or pooler in the path; the kernel's keepalives and
//! `tcp_user_timeout` see a healthy socket) would hold a caller for ever.
//! This is the same construction with `tokio::time::timeout` around each
//! call: the server answers any statement within its `statement_timeout`
//! (with an error at worst), so no answer within that plus a slack means the
//! path is broken. The client is then closed: nothing more is sent on it
//! (a `ROLLBACK` would wait again), and the next transaction reconnects.

use std::cell::Cell;
use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement, ToStatement};

use super::pg_tls::Connector;

/// What a call on the client can fail with.
#[derive(Debug)]
pub(crate) enum PgError {
    /// The driver's or the server's error.
    Pg(tokio_postgres::Error),
    /// No answer within the bound: the connection is given up.
    TimedOut,
    /// The runtime could not be built (out of threads or file descriptors).
    Io(std::io::ErrorKind),
}

impl From<tokio_postgres::Error> for PgError {
    fn from(e: tokio_postgres::Error) -> Self {
        PgError::Pg(e)
    }
}

impl PgError {
    /// The server's error, when the server said one.
    pub(crate) fn as_db_error(&self) -> Option<&tokio_postgres::error::DbError> {
        match self {
            PgError::Pg(e) => e.as_db_error(),
            _ => None,
        }
    }
}

impl std::fmt::Display for PgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PgError::Pg(e) => e.fmt(f),
            PgError::TimedOut => f.write_str("no answer from the server within the bound"),
            PgError::Io(k) => write!(f, "the client's runtime: {k}"),
        }
    }
}

/// One connection.
pub(crate) struct PgClient {
    rt: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
    /// How long one round trip may take.
    bound: Duration,
    /// A call ran out of its bound: the client is closed.
    timed_out: Cell<bool>,
}

impl PgClient {
    /// Connects (the TCP connect within the config's `connect_timeout`, the
    /// whole start-up, TLS included, within `bound`).
    pub(crate) fn connect(
        config: &tokio_postgres::Config,
        connector: &Connector,
        bound: Duration,
    ) -> Result<PgClient, PgError> {
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| PgError::Io(e.kind()))?;
        // (The timer is made inside the runtime: it needs its clock.)
        let started = rt.block_on(async {
            tokio::time::timeout(bound, async {
                // The connection is a task of this runtime: it runs while a call
                // blocks on the runtime, as the `postgres` crate's does.
                match connector {
                    Connector::Plain => {
                        let (client, conn) = config.connect(tokio_postgres::NoTls).await?;
                        tokio::spawn(async move {
                            let _ = conn.await;
                        });
                        Ok::<_, tokio_postgres::Error>(client)
                    }
                    Connector::Tls(tls) => {
                        let (client, conn) = config.connect(tls.clone()).await?;
                        tokio::spawn(async move {
                            let _ = conn.await;
                        });
                        Ok(client)
                    }
                }
            })
            .await
        });
        let client = started.map_err(|_| PgError::TimedOut)??;
        Ok(PgClient { rt, client, bound, timed_out: Cell::new(false) })
    }

    fn run<T>(&self, call: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>) -> Result<T, PgError> {
        self.run_within(call, self.bound)
    }

    fn run_within<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
        bound: Duration,
    ) -> Result<T, PgError> {
        if self.timed_out.get() {
            return Err(PgError::TimedOut);
        }
        if let Ok(r) = self.rt.block_on(async { tokio::time::timeout(bound, call).await }) {
            return r.map_err(PgError::Pg);
        }
        self.timed_out.set(true);
        tracing::warn!(
            bound_ms = bound.as_millis() as u64,
            "PostgreSQL did not answer within the bound; the connection is given up"
        );
        Err(PgError::TimedOut)
    }

    /// Whether the connection is gone (closed by the server, or given up).
    pub(crate) fn is_closed(&self) -> bool {
        self.timed_out.get() || self.client.is_closed()
    }

    pub(crate) fn batch_execute(&self, sql: &str) -> Result<(), PgError> {
        self.run(self.client.batch_execute(sql))
    }

    /// [`PgClient::batch_execute`] with a bound of its own (a migration).
    pub(crate) fn batch_execute_within(&self, sql: &str, bound: Duration) -> Result<(), PgError> {
        self.run_within(self.client.batch_execute(sql), bound)
    }

    pub(crate) fn prepare(&self, sql: &str) -> Result<Statement, PgError> {
        self.run(self.client.prepare(sql))
    }

    pub(crate) fn execute<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, PgError> {
        self.run(self.client.execute(statement, params))
    }

    pub(crate) fn query<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, PgError> {
        self.run(self.client.query(statement, params))
    }

    pub(crate) fn query_one<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, PgError> {
        self.run(self.client.query_one(statement, params))
    }

    pub(crate) fn query_opt<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, PgError> {
        self.run(self.client.query_opt(statement, params))
    }
}

/// The bound on one round trip: the session's `statement_timeout` (as the
/// URL's options set it, else toolgate's) and 5 s for the network.
pub(crate) fn bound_for(options: &str, default_statement_timeout: Duration) -> Duration {
    let given = options.split_whitespace().filter_map(|w| w.strip_prefix("statement_timeout=")).next_back();
    let statement = given.and_then(parse_duration).unwrap_or(default_statement_timeout);
    // 0 is "no statement timeout": then toolgate's own bound still holds.
    let statement = if statement.is_zero() { default_statement_timeout } else { statement };
    statement + Duration::from_secs(5)
}

/// A PostgreSQL duration setting: `120s`, `2min`, `1500ms`, `1500` (ms).
fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim().trim_matches('\'');
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let n: u64 = v[..digits].parse().ok()?;
    Some(match v[digits..].trim() {
        "us" => Duration::from_micros(n),
        "" | "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "min" => Duration::from_secs(n.checked_mul(60)?),
        "h" => Duration::from_secs(n.checked_mul(3_600)?),
        "d" => Duration::from_secs(n.checked_mul(86_400)?),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_follows_the_sessions_statement_timeout() {
        let d = Duration::from_secs(120);
        assert_eq!(bound_for("", d), Duration::from_secs(125));
        assert_eq!(bound_for("-c statement_timeout=2s", d), Duration::from_secs(7));
        assert_eq!(bound_for("-c lock_timeout=1s -c statement_timeout=1500", d), Duration::from_millis(6500));
        assert_eq!(bound_for("-c statement_timeout=0", d), Duration::from_secs(125));
        assert_eq!(bound_for("-c statement_timeout=soon", d), Duration::from_secs(125));
    }
}
