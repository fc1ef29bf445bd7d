//! Observability (docs/design.md §12): the trace export, metrics computed from the
//! database and their Prometheus text format. (The diagnostic log, which needs
//! a subscriber, is the binary's: `toolgate::telemetry::logging`.)
//!
//! - [`export`]: trace events as JSON lines with stable field names, and as text.
//! - [`metrics`]: [`metrics::snapshot`], every metric at one instant, read from
//!   the rollups the trace insert maintains (never a scan of the trace).
//! - [`histogram`]: latency buckets and nearest-rank percentiles.
//! - [`prometheus`]: the text exposition format of a snapshot.
//!
//! Redaction is structural: the trace can only hold what
//! [`crate::engine::TraceEvent`] has fields for (ids, digests, classes, salted
//! hashes), and everything here is computed from the trace and the ledger's
//! aggregates, so no argument, secret, authorization header or result body can
//! reach an export or the log.

pub mod export;
pub mod histogram;
pub mod metrics;
pub mod prometheus;

use crate::store::StoreError;

/// Errors of the exports: the database, or the output went away.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// Storage.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Writing the export failed.
    #[error("cannot write the export: {0}")]
    Io(#[from] std::io::Error),
}

impl crate::Coded for TelemetryError {
    /// Stable code for the CLI.
    fn code(&self) -> &'static str {
        match self {
            TelemetryError::Store(e) => e.code(),
            TelemetryError::Io(_) => "OUTPUT_FAILED",
        }
    }
}

impl TelemetryError {
    /// Whether the reader went away (`toolgate trace | head`): not a failure.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, TelemetryError::Io(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}
