//! `toolgate dispatch` and `query`: reading a call's arguments and printing
//! its envelope.

use super::{print_json, CliError, DispatchArgs};
use crate::engine::envelope::Envelope;
use serde_json::Value;
use std::ffi::OsString;
use std::io::Read;

pub(super) fn read_args(a: &DispatchArgs) -> Result<Vec<u8>, CliError> {
    // The engine enforces the limit; reading stops one byte past it, so a huge
    // file is never read whole and the engine still sees that it is too large.
    const READ_CAP: u64 = crate::engine::canonical::MAX_INPUT_BYTES as u64 + 1;
    let read_all = |r: &mut dyn Read| -> Result<Vec<u8>, CliError> {
        let mut buf = Vec::new();
        r.take(READ_CAP)
            .read_to_end(&mut buf)
            .map_err(|e| CliError::new("ARGS_UNREADABLE", format!("cannot read the arguments: {}", e.kind())))?;
        Ok(buf)
    };
    if let Some(f) = &a.args_file {
        let mut file = std::fs::File::open(f)
            .map_err(|e| CliError::new("ARGS_UNREADABLE", format!("cannot read the arguments file: {}", e.kind())))?;
        return read_all(&mut file);
    }
    match &a.args {
        None => Ok(b"{}".to_vec()),
        Some(s) if s == "-" => read_all(&mut std::io::stdin()),
        Some(s) => Ok(os_bytes(s)),
    }
}

#[cfg(unix)]
pub(super) fn os_bytes(s: &OsString) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    s.as_os_str().as_bytes().to_vec()
}

#[cfg(not(unix))]
pub(super) fn os_bytes(s: &OsString) -> Vec<u8> {
    s.to_string_lossy().as_bytes().to_vec()
}

/// Prints an envelope: the whole envelope (docs/design.md §4) as JSON, or a summary for people.
pub fn print_envelope(env: &Envelope, json: bool) {
    if json {
        print_json(env);
        return;
    }
    let m = &env.model_result;
    let exec = serde_json::to_value(m.execution).unwrap_or(Value::Null);
    let status = serde_json::to_value(m.status).unwrap_or(Value::Null);
    outln!(
        "status: {}   outcome: {}   delivery: {}",
        status.as_str().unwrap_or("?"),
        exec["outcome"].as_str().unwrap_or("?"),
        exec["delivery"].as_str().unwrap_or("?")
    );
    if let Some(e) = &m.error {
        let rec = serde_json::to_value(e.recovery).unwrap_or(Value::Null);
        outln!(
            "error: {}   recovery: {}   retryable: {}{}",
            e.code,
            rec.as_str().unwrap_or("?"),
            if e.retryable { "yes" } else { "no" },
            e.retry_after_ms.map_or(String::new(), |ms| format!("   retry_after_ms: {ms}"))
        );
        outln!("message: {}", e.message);
        if let Some(d) = &e.detail {
            outln!("detail: {d}");
        }
    }
    if let Some(d) = &m.data {
        outln!("data: {d}");
    }
    let a = &env.protected_audit;
    if let Some(op) = &a.operation_id {
        outln!("operation: {op}");
    }
    if let Some(ap) = &a.approval_id {
        outln!("approval: {ap}");
    }
    if let Some(s) = &a.downstream.status_ref {
        outln!("status_ref: {s}");
    }
    if let Some(r) = &a.binding.request_sha256 {
        outln!("request_sha256: {r}");
    }
    if let Some(r) = &a.downstream.receipt_id {
        outln!("receipt: {r}");
    }
}
