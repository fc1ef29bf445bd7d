//! The trace as an export: one flat JSON object per event with stable field
//! names (`toolgate trace --format jsonl`, `ops show --json`), and a one-line
//! human summary (`ops show`, `toolgate trace`).
//!
//! What an event can hold is fixed by [`crate::engine::TraceEvent`]: ids,
//! digests, classes and salted hashes. Tenant and subject appear only as
//! `tenant_ref` / `subject_ref`; arguments only as `arguments_sha256` +
//! `data_classification`; replies and results only as ids and digests.

use std::io::Write;

use serde_json::{Map, Value};

use super::TelemetryError;
use crate::engine::clock::rfc3339;
use crate::store::TraceRow;

/// Version of the exported event shape (the `v` field).
pub const EXPORT_VERSION: i64 = 1;

/// How many events one read transaction pages through.
const PAGE: i64 = 2_000;

/// One event as a flat JSON object. The columns are always present (`null`
/// when absent); the step's other fields follow when set.
pub fn event_json(t: &TraceRow) -> Value {
    let mut m = Map::new();
    if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&t.fields) {
        m.extend(fields);
    }
    let s = |v: &Option<String>| v.clone().map_or(Value::Null, Value::String);
    let n = |v: Option<i64>| v.map_or(Value::Null, Value::from);
    for (k, v) in [
        ("v", Value::from(EXPORT_VERSION)),
        ("seq", Value::from(t.seq)),
        ("at", Value::String(rfc3339(t.at))),
        ("at_ms", Value::from(t.at)),
        ("step", Value::String(t.step.clone())),
        ("operation_id", s(&t.operation_id)),
        ("tool", s(&t.tool)),
        ("tool_version", s(&t.tool_version)),
        ("tenant_ref", s(&t.tenant_ref)),
        ("answer", s(&t.answer)),
        ("code", s(&t.code)),
        ("outcome", s(&t.outcome)),
        ("delivery", s(&t.delivery)),
        ("reason", s(&t.reason)),
        ("timeout_stage", s(&t.timeout_stage)),
        ("attempt", n(t.attempt)),
        ("duration_us", n(t.duration_us)),
        ("latency_us", n(t.latency_us)),
    ] {
        m.insert(k.to_string(), v);
    }
    Value::Object(m)
}

/// A one-line summary of what an event adds to the story (for people).
pub fn describe(t: &TraceRow) -> String {
    let f: Map<String, Value> = match serde_json::from_str::<Value>(&t.fields) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    let mut parts: Vec<String> = Vec::new();
    if let Some(a) = &t.answer {
        parts.push(format!("answers {a}"));
    }
    if let Some(r) = &t.reason {
        parts.push(format!("[{r}]"));
    }
    if let Some(note) = f.get("note").and_then(Value::as_str) {
        parts.push(note.to_string());
    }
    if let Some(c) = f.get("checks_passed").and_then(Value::as_array) {
        let names: Vec<&str> = c.iter().filter_map(Value::as_str).collect();
        parts.push(format!("passed {}", names.join(",")));
    }
    if let Some(stage) = &t.timeout_stage {
        parts.push(format!("timeout at {stage}"));
    }
    if f.get("downstream_committed").and_then(Value::as_bool) == Some(true) {
        parts.push("downstream committed".into());
    }
    for (key, label) in [
        ("receipt_id", "receipt"),
        ("downstream_request_id", "downstream request"),
        ("approval_id", "approval"),
        ("worker", "worker"),
    ] {
        if let Some(v) = f.get(key).and_then(Value::as_str) {
            parts.push(format!("{label} {v}"));
        }
    }
    if let Some(r) = refusal_of(&f) {
        parts.push(r);
    }
    if let Some(v) = f.get("retry_after_ms").and_then(Value::as_u64) {
        parts.push(format!("retry after {v} ms"));
    }
    if let Some(v) = f.get("deadline_left_ms").and_then(Value::as_i64) {
        parts.push(format!("deadline left {v} ms"));
    }
    if let Some(v) = t.latency_us {
        parts.push(format!("latency {}", human_us(v)));
    } else if let Some(v) = t.duration_us {
        parts.push(format!("took {}", human_us(v)));
    }
    parts.join("  ")
}

/// What a downstream's refusal said, for people: `downstream said HTTP 401,
/// body sha256 3f2a…: "invalid api key"` (the excerpt is already bounded and
/// redacted when it is recorded).
pub fn refusal(t: &TraceRow) -> Option<String> {
    match serde_json::from_str::<Value>(&t.fields) {
        Ok(Value::Object(m)) => refusal_of(&m),
        _ => None,
    }
}

fn refusal_of(f: &Map<String, Value>) -> Option<String> {
    let r = f.get("refusal")?.as_object()?;
    let status = r.get("status").and_then(Value::as_u64).unwrap_or(0);
    let sha = r.get("body_sha256").and_then(Value::as_str).unwrap_or("");
    let excerpt = r.get("excerpt").and_then(Value::as_str).unwrap_or("");
    let sha = sha.get(..12).unwrap_or(sha);
    Some(if status == 0 {
        // Not HTTP: an MCP tool's isError result, its content as the body.
        format!("the MCP tool answered isError, content sha256 {sha}…: {excerpt:?}")
    } else {
        format!("downstream said HTTP {status}, body sha256 {sha}…: {excerpt:?}")
    })
}

fn human_us(us: i64) -> String {
    if us < 1_000 {
        format!("{us} µs")
    } else if us < 1_000_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else {
        format!("{:.2} s", us as f64 / 1e6)
    }
}

/// One text line per event: time, step, code, outcome, delivery, attempt, summary.
pub fn text_line(t: &TraceRow) -> String {
    format!(
        "{} #{:<6} {:<28} {:<16} {:<24} {:<12} {:<18} {:<9} {}",
        rfc3339(t.at),
        t.seq,
        t.operation_id.as_deref().unwrap_or("-"),
        t.step,
        t.code.as_deref().unwrap_or("-"),
        t.outcome.as_deref().unwrap_or("-"),
        t.delivery.as_deref().unwrap_or("-"),
        t.attempt.map_or(String::new(), |a| format!("attempt {a}")),
        describe(t)
    )
}

/// The export format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line.
    Jsonl,
    /// [`text_line`] per event.
    Text,
}

/// Writes every event at or after `since_ms` (all of them for `i64::MIN`), in
/// sequence order, paging through the trace so that a million events never
/// sit in memory at once. Returns how many were written.
pub fn export(
    store: &mut crate::engine::Engine,
    since_ms: i64,
    format: Format,
    out: &mut dyn Write,
) -> Result<u64, TelemetryError> {
    let mut after = 0;
    let mut written = 0;
    loop {
        let page = store.read(|tx| tx.trace_since(after, since_ms, PAGE))?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        for t in &page {
            write_event(t, format, out)?;
            written += 1;
        }
    }
    out.flush()?;
    Ok(written)
}

/// Writes one event in a format.
pub fn write_event(t: &TraceRow, format: Format, out: &mut dyn Write) -> Result<(), TelemetryError> {
    match format {
        Format::Jsonl => writeln!(out, "{}", event_json(t))?,
        Format::Text => writeln!(out, "{}", text_line(t))?,
    }
    Ok(())
}
