//! `toolgate trace`, `toolgate metrics` and `ops show`'s detail: what happened.

use super::{open_read, Cli, CliError, MetricsArgs, MetricsFormatArg, TraceArgs, TraceFormatArg};
use crate::engine::clock::{parse_rfc3339, rfc3339};
use crate::engine::{Engine, EngineError};
use crate::store::AttemptOutcome;
use crate::Coded;
use serde_json::Value;

pub(super) fn trace_json(t: &crate::store::TraceRow) -> Value {
    crate::telemetry::export::event_json(t)
}

/// `toolgate trace`: the whole trace (or one operation's) as text or JSON lines.
pub(super) fn trace_command(cli: &Cli, a: &TraceArgs) -> Result<i32, CliError> {
    use crate::telemetry::export::{self, Format};
    let since = match &a.since {
        None => i64::MIN,
        Some(s) => parse_rfc3339(s)
            .ok_or_else(|| CliError::new("BAD_TIME", "--since must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z"))?,
    };
    let format = match a.format {
        _ if a.json => Format::Jsonl,
        TraceFormatArg::Text => Format::Text,
        TraceFormatArg::Jsonl => Format::Jsonl,
    };
    let mut engine = open_read(cli)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let written = match &a.operation {
        Some(id) => {
            engine.read(|tx| tx.trace_for(id)).map_err(crate::telemetry::TelemetryError::from).and_then(|rows| {
                for t in rows.iter().filter(|t| t.at >= since) {
                    export::write_event(t, format, &mut out)?;
                }
                std::io::Write::flush(&mut out)?;
                Ok(rows.len() as u64)
            })
        }
        None => export::export(&mut engine, since, format, &mut out),
    };
    match written {
        Ok(_) => Ok(0),
        Err(e) if e.is_broken_pipe() => Ok(0),
        Err(e) => Err(CliError::new(e.code(), e.to_string())),
    }
}

/// `toolgate metrics`: print once, or serve `/metrics` until killed.
pub(super) fn metrics_command(cli: &Cli, a: &MetricsArgs) -> Result<i32, CliError> {
    use crate::telemetry::{metrics, prometheus};
    let mut engine = open_read(cli)?;
    let window = metrics::Window::with_buckets(a.window_minutes, a.bucket_minutes);
    let slice = metrics::Slice {
        tool: a.tool.clone(),
        tenant_ref: a.tenant.as_deref().map(|t| engine.hashed("tenant", t)),
        risk: a.risk.clone(),
        version: a.tool_version.clone(),
    };
    let format = if a.json { MetricsFormatArg::Json } else { a.format };
    let render = move |engine: &mut Engine| -> Result<String, EngineError> {
        let snap = metrics::snapshot(engine, window, &slice)?;
        Ok(match format {
            MetricsFormatArg::Prometheus => prometheus::render(&snap),
            MetricsFormatArg::Json => serde_json::to_string_pretty(&snap).unwrap_or_else(|_| "null".into()) + "\n",
        })
    };
    let Some(addr) = &a.listen else {
        out!("{}", render(&mut engine)?);
        return Ok(0);
    };
    let listen: std::net::SocketAddr = addr.parse().map_err(|_| {
        CliError::new("INVALID_ARGUMENTS", format!("--listen {addr}: not an address (HOST:PORT, e.g. 127.0.0.1:9184)"))
    })?;
    let content_type = match format {
        MetricsFormatArg::Prometheus => prometheus::CONTENT_TYPE,
        MetricsFormatArg::Json => "application/json",
    };
    crate::api::serve_metrics(
        engine,
        listen,
        move |e| render(e).map(|body| (content_type, body)),
        |local| {
            // The first line tells a caller (or a test that asked for port 0) where to scrape.
            outln!("listening on http://{local}/metrics");
            let _ = std::io::Write::flush(&mut std::io::stdout());
            tracing::info!(addr = %local, "serving /metrics");
        },
    )
    .map_err(CliError::from)?;
    Ok(0)
}

pub(super) fn print_detail(d: &crate::engine::OperationDetail) {
    let o = &d.operation;
    outln!("operation {}  ({} v{})", o.id, o.state, o.version);
    outln!(
        "  tool {}  effect {}  revisions in{}/out{}/eff{}",
        o.tool,
        o.effect,
        o.input_rev,
        o.output_rev,
        o.effect_rev
    );
    outln!("  key_sha256      {}", o.key_sha256);
    outln!("  request_sha256  {}", o.request_sha256);
    outln!("  result_sha256   {}", o.result_sha256.as_deref().unwrap_or("-"));
    outln!("  call_binding    {}", o.call_binding_sha256);
    outln!("  status_ref      {}", o.status_ref);
    outln!(
        "  downstream      request {}  receipt {}",
        o.downstream_request_id.as_deref().unwrap_or("-"),
        o.receipt_id.as_deref().unwrap_or("-")
    );
    if let Some(c) = &o.code {
        outln!("  code            {c}");
    }
    if let Some(until) = d.may_land_until {
        outln!("  may still land  until {} (a decision of no effect waits for it)", rfc3339(until));
    }
    if let Some(until) = d.receipt_window_until {
        outln!("  receipt window  until {} (a receipt may still appear: query again after it)", rfc3339(until));
    }
    for (label, value) in &d.context {
        outln!("  {:<15} {}", crate::display::escape(label), crate::display::escape(value));
    }
    if let Some(r) = &o.resolution {
        outln!(
            "  resolution      {r} by {} ({})",
            crate::display::escape(o.resolved_by.as_deref().unwrap_or("?")),
            crate::display::escape(o.resolution_note.as_deref().unwrap_or(""))
        );
    }
    if let Some(ob) = &d.outbox {
        outln!("  outbox          {} attempt {} (at most {} per call)", ob.state, ob.attempt, ob.max_attempts);
    }
    outln!("attempts:");
    for a in &d.attempts {
        outln!(
            "  #{} by {}  claimed {}  sent {}  -> {} {}",
            a.attempt,
            a.owner,
            rfc3339(a.claimed_at),
            a.sent_at.map_or("never".into(), rfc3339),
            a.outcome.map_or("open", AttemptOutcome::as_str),
            a.code.as_deref().unwrap_or("")
        );
    }
    outln!("trace:");
    for t in &d.trace {
        outln!(
            "  {} {:<16} {:<24} {:<12} {:<18} {:<9} {}",
            rfc3339(t.at),
            t.step,
            t.code.as_deref().unwrap_or("-"),
            t.outcome.as_deref().unwrap_or("-"),
            t.delivery.as_deref().unwrap_or("-"),
            t.attempt.map_or(String::new(), |a| format!("attempt {a}")),
            crate::telemetry::export::describe(t)
        );
    }
    if !d.audit.is_empty() {
        outln!("operator log:");
        for r in &d.audit {
            outln!(
                "  {} {} {} by {}: {}",
                rfc3339(r.at),
                r.action,
                r.result,
                crate::display::escape(&r.actor),
                crate::display::escape(&r.reason)
            );
        }
    }
}
