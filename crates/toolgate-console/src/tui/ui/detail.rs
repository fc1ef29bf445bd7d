//! The detail view of one operation: record, bindings, attempts, trace timeline,
//! operator log.

use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Wrap};
use ratatui::Frame;

use super::Theme;
use crate::engine::clock::rfc3339;
use crate::store::OutboxState;
use crate::tui::app::App;
use crate::tui::format::{due_in, human_ms, lapses_in};

/// `why` and `next` wrapped under their labels, so the label column stays clear.
fn why_lines(why: crate::tui::app::Why, width: u16, t: Theme) -> Vec<Line<'static>> {
    let room = usize::from(width.saturating_sub(9)).max(20);
    let mut lines = Vec::new();
    for (label, text, style) in [("why", why.sentence, t.warn()), ("next", why.next, t.accent())] {
        for (i, part) in super::lab::wrap(&text, room).into_iter().enumerate() {
            let label = if i == 0 { label } else { "" };
            lines.push(Line::from(vec![Span::styled(format!("  {label:<6}"), style), Span::raw(part)]));
        }
    }
    lines
}

/// The detail of a pending approval: why it waits, then what an approver sees.
fn render_approval(app: &App, a: &crate::store::ApprovalRow, frame: &mut Frame, area: Rect, t: Theme) -> u16 {
    let block =
        Block::default().borders(Borders::TOP).title(Span::styled(" Pending approval (Esc: back) ", t.accent()));
    let state = if app.now_ms >= a.expires_at { "expired" } else { "pending" };
    let mut lines = vec![Line::from(vec![
        Span::styled(format!("  {}  ", a.id), t.accent()),
        Span::styled(state, if state == "expired" { t.bad() } else { t.warn() }),
    ])];
    let refusal = app.may_decide(a).err();
    lines.extend(why_lines(crate::tui::app::explain_approval(a, app.now_ms, refusal.as_deref()), area.width, t));
    lines.extend(app.approval_evidence(a).into_iter().map(|e| Line::from(format!("  {e}"))));
    lines.push(Line::from(format!(
        "  requested   {} ({} ago)",
        rfc3339(a.created_at),
        human_ms(app.now_ms.saturating_sub(a.created_at))
    )));
    // As the operation's detail: the extent comes back, so j stops at the end.
    let paragraph = Paragraph::new(super::escaped(lines)).wrap(Wrap { trim: false });
    let inner = block.inner(area);
    let total = u16::try_from(paragraph.line_count(inner.width)).unwrap_or(u16::MAX);
    let extent = total.saturating_sub(inner.height);
    frame.render_widget(paragraph.block(block).scroll((app.detail.scroll.min(extent), 0)), area);
    extent
}

/// Draws the detail view.
pub fn render(app: &App, frame: &mut Frame, area: Rect, t: Theme) -> u16 {
    if let Some(a) = &app.detail.approval {
        return render_approval(app, a, frame, area, t);
    }
    let block =
        Block::default().borders(Borders::TOP).title(Span::styled(" Operation detail (Esc: back) ", t.accent()));
    let Some(d) = &app.detail.op else {
        frame.render_widget(Paragraph::new("  loading…").block(block), area);
        return 0;
    };
    let o = &d.operation;
    let kv = |k: &str, v: String| Line::from(vec![Span::styled(format!("  {k:<16}"), t.dim()), Span::raw(v)]);
    // A digest or reference longer than the value column: cut in pieces that
    // continue under the value column, never back at column 0.
    let room = usize::from(area.width.saturating_sub(20)).max(16);
    let kv_long = |k: &str, v: String| -> Vec<Line<'static>> {
        let chars: Vec<char> = v.chars().collect();
        chars
            .chunks(room)
            .enumerate()
            .map(|(i, part)| {
                let label = if i == 0 { k } else { "" };
                Line::from(vec![
                    Span::styled(format!("  {label:<16}"), t.dim()),
                    Span::raw(part.iter().collect::<String>()),
                ])
            })
            .collect()
    };
    let mut lines = vec![Line::from(vec![
        Span::styled(format!("  {}  ", o.id), t.accent()),
        Span::styled(o.state.as_str(), t.state(o.state)),
        Span::raw(format!("  version {}", o.version)),
    ])];
    // Not terminal: why it is where it is, and the next safe step, first.
    // Wrapped under their label, so the label column stays clear.
    if let Some(why) = crate::tui::app::explain(d, app.now_ms) {
        lines.extend(why_lines(why, area.width, t));
    }
    // What the call asked for, and what the provider's queries found: the
    // facts a person checks before deciding, before the rest.
    if let Some(terms) = crate::tui::app::request_terms(o) {
        lines.push(kv("amount", terms));
    }
    if let Some(r) = crate::tui::app::found_receipt(d).filter(|r| o.receipt_id.as_deref() != Some(&r.receipt_id)) {
        // Wrapped under the value column (the ids are what to check).
        let text = match &r.why_not {
            Some(w) => format!("{}; not this request's: {w}", r.ids()),
            None => r.ids(),
        };
        let room = usize::from(area.width.saturating_sub(18)).max(20);
        for (i, part) in super::lab::wrap(&text, room).into_iter().enumerate() {
            let label = if i == 0 { "query found" } else { "" };
            lines.push(Line::from(vec![Span::styled(format!("  {label:<16}"), t.dim()), Span::styled(part, t.warn())]));
        }
    }
    lines.extend([
        kv(
            "tool",
            format!("{} ({}), revisions in{}/out{}/eff{}", o.tool, o.effect, o.input_rev, o.output_rev, o.effect_rev),
        ),
        kv("scope", format!("{} / {} / key#{}", o.tenant, o.subject, crate::display::digest(&o.key_sha256, 16))),
        kv("call", format!("{} {} {} {}", o.call_provider, o.call_api_family, o.call_response_id, o.call_id)),
        kv("created", format!("{} ({} ago)", rfc3339(o.created_at), human_ms(app.now_ms.saturating_sub(o.created_at)))),
        // While it can still run, the deadline counts down (or says by how much it passed).
        kv(
            "deadline",
            if o.state.is_in_progress() {
                format!("{} ({})", rfc3339(o.deadline_at), due_in(app.now_ms, o.deadline_at))
            } else {
                rfc3339(o.deadline_at)
            },
        ),
        kv("code", o.code.clone().unwrap_or_else(|| "-".into())),
        Line::from(Span::styled("  bindings", t.accent())),
    ]);
    lines.extend(kv_long("request_sha256", o.request_sha256.clone()));
    lines.extend(kv_long("result_sha256", o.result_sha256.clone().unwrap_or_else(|| "-".into())));
    lines.extend(kv_long("call_binding", o.call_binding_sha256.clone()));
    lines.extend(kv_long("status_ref", o.status_ref.clone()));
    lines.extend([
        kv(
            "downstream",
            format!(
                "request {}  receipt {}",
                o.downstream_request_id.as_deref().unwrap_or("-"),
                o.receipt_id.as_deref().unwrap_or("-")
            ),
        ),
        kv(
            "last query",
            format!(
                "{} {}",
                o.last_query_result.as_deref().unwrap_or("none"),
                o.last_query_at
                    .map(|a| format!("({} ago)", human_ms(app.now_ms.saturating_sub(a))))
                    .unwrap_or_default()
            ),
        ),
    ]);
    // The resource as it is now (the tool's domain says what that is).
    for (label, value) in &d.context {
        lines.push(kv(label, value.clone()));
    }
    if let Some(r) = &o.resolution {
        lines.push(kv(
            "resolution",
            format!(
                "{r} by {}: {}",
                o.resolved_by.as_deref().unwrap_or("?"),
                o.resolution_note.as_deref().unwrap_or("")
            ),
        ));
    }
    if let Some(ob) = &d.outbox {
        lines.push(kv(
            "outbox",
            format!(
                "{} · attempt {} (at most {} per call) · {}",
                ob.state,
                ob.attempt,
                ob.max_attempts,
                ob.last_code.as_deref().unwrap_or("-")
            ),
        ));
        match (ob.state, ob.lease_until) {
            (OutboxState::Leased, Some(until)) => lines.push(kv(
                "lease until",
                format!(
                    "{} ({}), worker {}",
                    rfc3339(until),
                    lapses_in(app.now_ms, until),
                    ob.lease_owner.as_deref().unwrap_or("?")
                ),
            )),
            (OutboxState::Pending, _) => lines.push(kv(
                "next retry",
                format!("{} ({})", rfc3339(ob.available_at), due_in(app.now_ms, ob.available_at)),
            )),
            _ => {}
        }
    }
    lines.push(Line::from(Span::styled("  attempts", t.accent())));
    for a in &d.attempts {
        lines.push(Line::from(format!(
            "    #{} {}  sent {}  → {} {}",
            a.attempt,
            a.owner,
            a.sent_at.map_or_else(|| "never".to_string(), |s| rfc3339(s).chars().skip(11).take(12).collect::<String>()),
            a.outcome.map_or("open", crate::store::AttemptOutcome::as_str),
            a.code.as_deref().unwrap_or("")
        )));
    }
    lines.push(Line::from(Span::styled("  trace timeline", t.accent())));
    for e in &d.trace {
        lines.push(Line::from(vec![
            Span::styled(format!("    {} ", rfc3339(e.at).chars().skip(11).take(12).collect::<String>()), t.dim()),
            Span::raw(format!("{:<16} ", e.step)),
            Span::styled(format!("{:<24} ", e.code.as_deref().unwrap_or("")), t.warn()),
            Span::raw(format!("{} {}", e.outcome.as_deref().unwrap_or(""), e.delivery.as_deref().unwrap_or(""))),
            Span::styled(e.attempt.map(|a| format!("  attempt {a}")).unwrap_or_default(), t.dim()),
        ]));
        // A downstream's refusal says why on the next line (status, body
        // digest, redacted excerpt): the operator needs it to fix a secret.
        if let Some(said) = crate::telemetry::export::refusal(e) {
            lines.push(Line::from(Span::styled(format!("      {said}"), t.dim())));
        }
    }
    if !d.audit.is_empty() {
        lines.push(Line::from(Span::styled("  operator log", t.accent())));
        for r in &d.audit {
            lines.push(Line::from(format!(
                "    {} {} {} by {}: {}",
                rfc3339(r.at).chars().skip(11).take(8).collect::<String>(),
                r.action,
                r.result,
                r.actor,
                r.reason
            )));
        }
    }
    let paragraph = Paragraph::new(super::escaped(lines)).wrap(Wrap { trim: false });
    let inner = block.inner(area);
    let total = u16::try_from(paragraph.line_count(inner.width)).unwrap_or(u16::MAX);
    let extent = total.saturating_sub(inner.height);
    // Following: the end (the newest trace events) stays in view; never past it.
    let scroll = if app.detail.follow { extent } else { app.detail.scroll.min(extent) };
    frame.render_widget(paragraph.block(block).scroll((scroll, 0)), area);
    extent
}
