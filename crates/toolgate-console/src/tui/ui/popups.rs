//! Popups: help (generated from the keymap), confirm dialogs (default Cancel,
//! with the evidence), and the resolve / deny forms.

use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph};
use ratatui::Frame;

use super::Theme;
use crate::tui::app::{App, BulkKey, FormKind, Mode, Request, COMMANDS};
use crate::tui::keymap;

fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let [v] = Layout::vertical([Constraint::Length(h.min(area.height))]).flex(Flex::Center).areas(area);
    let [c] = Layout::horizontal([Constraint::Length(w.min(area.width))]).flex(Flex::Center).areas(v);
    c
}

/// The help overlay for the mode help was opened from: its keys, then the
/// command bar's commands (both from their tables), wrapped to the terminal
/// (nothing is cut). Scrolls with j/k when it is taller than the terminal.
pub fn help(app: &App, frame: &mut Frame, t: Theme) {
    const KEYS: usize = 27;
    if app.help.messages {
        return messages(app, frame, t);
    }
    let w = frame.area().width.min(120);
    let text_w = usize::from(w.saturating_sub(2)).saturating_sub(KEYS).max(10);
    let mut entries: Vec<(String, String)> = keymap::help_lines(app.help.return_to, app.read_only)
        .iter()
        .map(|(k, h)| ((*k).to_string(), (*h).to_string()))
        .collect();
    let mut lines: Vec<Line> = Vec::new();
    let push = |lines: &mut Vec<Line>, entries: &mut Vec<(String, String)>| {
        for (k, h) in entries.drain(..) {
            for (i, part) in super::lab::wrap(&h, text_w).into_iter().enumerate() {
                let key = if i == 0 { k.as_str() } else { "" };
                lines.push(Line::from(vec![Span::styled(format!(" {key:<26}"), t.accent()), Span::raw(part)]));
            }
        }
    };
    push(&mut lines, &mut entries);
    if app.read_only {
        lines.push(Line::from(Span::styled(" read-only: state-changing keys are hidden", t.warn())));
    }
    lines.push(Line::from(Span::styled(" commands (type : first; Tab completes, Up/Down history)", t.dim())));
    let mut commands: Vec<(String, String)> = COMMANDS
        .iter()
        .map(|c| {
            let name = if c.args.is_empty() { format!(":{}", c.name) } else { format!(":{} {}", c.name, c.args) };
            (name, c.help.to_string())
        })
        .collect();
    push(&mut lines, &mut commands);
    let h = (lines.len() as u16 + 2).min(frame.area().height);
    let inner = h.saturating_sub(2);
    let max_scroll = (lines.len() as u16).saturating_sub(inner);
    let scroll = app.help.scroll.min(max_scroll);
    let title = if max_scroll == 0 {
        " Keys (? or Esc to close) ".to_string()
    } else {
        format!(" Keys (? or Esc to close) · j/k scroll {scroll}/{max_scroll} ")
    };
    let area = centered(frame.area(), w, h);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(lines).scroll((scroll, 0)).block(Block::default().borders(Borders::ALL).title(title)),
        area,
    );
}

/// The message log (`:messages`): every status message of the session.
fn messages(app: &App, frame: &mut Frame, t: Theme) {
    let w = frame.area().width.min(120);
    let text_w = usize::from(w.saturating_sub(2)).saturating_sub(11).max(10);
    let mut lines: Vec<Line> = Vec::new();
    for (at, text, error) in app.messages.iter().rev() {
        let stamp = crate::engine::clock::rfc3339(*at).chars().skip(11).take(8).collect::<String>();
        let style = if *error { t.bad() } else { t.ok() };
        for (i, part) in super::lab::wrap(text, text_w).into_iter().enumerate() {
            let head = if i == 0 { format!(" {stamp}  ") } else { " ".repeat(11) };
            lines.push(Line::from(vec![Span::styled(head, t.dim()), Span::styled(part, style)]));
        }
    }
    if lines.is_empty() {
        lines.push(Line::from(Span::styled(" no messages yet", t.dim())));
    }
    let h = (lines.len() as u16 + 2).min(frame.area().height);
    let max_scroll = (lines.len() as u16).saturating_sub(h.saturating_sub(2));
    let scroll = app.help.scroll.min(max_scroll);
    let title = format!(" Messages, newest first ({}; Esc to close, j/k scroll) ", app.messages.len());
    let area = centered(frame.area(), w, h);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(super::escaped(lines))
            .scroll((scroll, 0))
            .block(Block::default().borders(Borders::ALL).title(Span::styled(title, t.accent()))),
        area,
    );
}

/// The command bar's candidates (completions, or the operations an ambiguous
/// `:op` prefix matched), listed just above the bar.
pub fn command_candidates(app: &App, frame: &mut Frame, footer: Rect, t: Theme) {
    let c = &app.command;
    if c.candidates.is_empty() {
        return;
    }
    let mut lines: Vec<Line> = c
        .candidates
        .iter()
        .map(|id| Line::from(Span::raw(format!(" {}", crate::tui::format::short(id, 60)))))
        .collect();
    if c.more {
        lines.push(Line::from(Span::styled(" … and more: type more of the id", t.dim())));
    }
    let h = (lines.len() as u16 + 2).min(footer.y);
    let w = 64u16.min(footer.width);
    let area = Rect { x: footer.x, y: footer.y.saturating_sub(h), width: w, height: h };
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(lines)
            .block(Block::default().borders(Borders::ALL).title(Span::styled(" matches ", t.accent()))),
        area,
    );
}

fn buttons(request: &Request, on_confirm: bool, t: Theme) -> Line<'static> {
    let b = |label: &str, focused: bool| {
        let style = if focused { t.accent().add_modifier(Modifier::REVERSED) } else { t.dim() };
        Span::styled(format!("[ {label} ]"), style)
    };
    let (back, act) = button_labels(request);
    Line::from(vec![Span::raw("   "), b(back, !on_confirm), Span::raw("   "), b(&act, on_confirm)])
}

/// The two buttons, named by what they do: "Cancel" on a dialog that
/// cancels an operation read both ways.
fn button_labels(request: &Request) -> (&'static str, String) {
    match request {
        Request::Cancel { .. } => ("Keep it", "Cancel operation".into()),
        Request::Query { .. } => ("Go back", "Query the provider".into()),
        Request::Approve { .. } => ("Go back", "Approve".into()),
        Request::Deny { .. } => ("Go back", "Deny".into()),
        Request::Resolve { resolution, against_evidence: true, .. } => {
            ("Go back", format!("Resolve as {} against the evidence", resolution.as_str()))
        }
        Request::Resolve { resolution, .. } => ("Go back", format!("Resolve as {}", resolution.as_str())),
        Request::SetLab(Some(_)) => ("Go back", "Turn the defense off".into()),
        Request::SetLab(None) => ("Go back", "Turn every defense on".into()),
        Request::Bulk { action, targets } => ("Go back", format!("{} {}", capitalized(action.verb()), targets.len())),
        _ => ("Go back", "Confirm".into()),
    }
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().collect::<String>() + c.as_str())
}

/// `text` in lines at most `width` cells wide; lines after the first are
/// indented by `indent` (the evidence's value column), and a word longer than
/// a line is cut across lines (a digest, an id), so nothing runs past the border.
fn wrap_hanging(text: &str, width: usize, indent: usize) -> Vec<String> {
    let width = width.max(indent + 8);
    let mut out: Vec<String> = Vec::new();
    let mut line = String::new();
    // Cells used on this line, and where its text starts.
    let (mut len, mut start) = (0usize, 0usize);
    for word in text.split(' ') {
        let mut rest: Vec<char> = word.chars().collect();
        loop {
            let gap = usize::from(len > start);
            if len + gap + rest.len() <= width {
                line.extend(std::iter::repeat_n(' ', gap).chain(rest.iter().copied()));
                len += gap + rest.len();
                break;
            }
            if len == start || rest.len() > width - indent {
                // A word longer than a line: what fits here, the rest below.
                let take = width.saturating_sub(len + gap).min(rest.len());
                line.extend(std::iter::repeat_n(' ', gap).chain(rest.drain(..take)));
            }
            out.push(std::mem::take(&mut line));
            line = " ".repeat(indent);
            (len, start) = (indent, indent);
            if rest.is_empty() {
                break;
            }
        }
    }
    if len > start || out.is_empty() {
        out.push(line);
    }
    out
}

/// The confirm dialog's lines: the evidence wrapped inside the border under
/// its value column, cut (with a line saying so) so that the blank line and
/// the buttons always fit in `height` rows.
pub(super) fn confirm_lines(evidence: &[String], width: u16, height: u16) -> Vec<String> {
    // Inside the border, after the one-cell margin.
    let text_w = usize::from(width.saturating_sub(3));
    let mut lines: Vec<String> = Vec::new();
    for e in evidence {
        let e = crate::display::escape(e);
        // An indented line (a list under a heading) keeps its indent.
        let body = e.trim_start_matches(' ');
        let lead = " ".repeat(e.len() - body.len());
        // "label       value": continuation lines start under the value.
        let indent = if body.chars().nth(11) == Some(' ') && lead.is_empty() { 12 } else { 2 };
        lines.extend(
            wrap_hanging(body, text_w.saturating_sub(lead.len()), indent).into_iter().map(|l| lead.clone() + &l),
        );
    }
    // Borders (2), the blank line and the buttons (2).
    let room = usize::from(height.saturating_sub(4)).max(1);
    if lines.len() > room {
        lines.truncate(room - 1);
        lines.push("… (cut to fit the terminal: the detail view has the rest)".chars().take(text_w).collect());
    }
    lines
}

/// A confirm dialog: the evidence wrapped inside the border, the buttons
/// always on screen below it.
pub fn confirm(app: &App, frame: &mut Frame, t: Theme) {
    let Some(c) = &app.dialog.confirm else { return };
    let full = frame.area();
    let w = full.width.saturating_sub(4).clamp(40, 100).min(full.width);
    // Over the body: the header's first line and the footer stay in view.
    let h_max = full.height.saturating_sub(3);
    let mut lines: Vec<Line> =
        confirm_lines(&c.evidence, w, h_max).into_iter().map(|e| Line::from(format!(" {e}"))).collect();
    lines.push(Line::from(""));
    lines.push(buttons(&c.request, c.on_confirm, t));
    let area = centered(full, w, lines.len() as u16 + 2);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(super::escaped(lines))
            .block(Block::default().borders(Borders::ALL).title(Span::styled(format!(" {} ", c.title), t.accent()))),
        area,
    );
}

/// The resolution choices, the chosen one highlighted.
fn choice_line(choice: Option<usize>, label: ratatui::style::Style, t: Theme) -> Line<'static> {
    let mut spans = vec![Span::styled(" resolve as  ", label)];
    for (i, c) in ["succeeded", "failed", "compensated"].iter().enumerate() {
        let s = if Some(i) == choice { t.accent().add_modifier(Modifier::REVERSED) } else { t.dim() };
        spans.push(Span::styled(format!(" {c} "), s));
        spans.push(Span::raw(" "));
    }
    Line::from(spans)
}

/// The resolve / deny / cancel form (one row, or the marked rows).
pub fn form(app: &App, frame: &mut Frame, t: Theme) {
    let Some(f) = &app.dialog.form else { return };
    let focus = |i: usize| if f.field == i && app.mode == Mode::Form { t.accent() } else { t.dim() };
    let caret = |i: usize| if f.field == i { "▏" } else { "" };
    let mut lines = Vec::new();
    let title = match &f.kind {
        FormKind::Deny { evidence, .. } => {
            // The same evidence as approve.
            lines.extend(evidence.iter().map(|e| Line::from(format!(" {e}"))));
            " Deny approval ".to_string()
        }
        FormKind::Cancel { operation_id, state, .. } => {
            lines.push(Line::from(format!(" cancel {operation_id} ({state})")));
            " Cancel operation ".to_string()
        }
        FormKind::Bulk { plan } => {
            let n = plan.targets.len();
            lines.push(Line::from(format!(
                " {n} marked row{} ({} skipped); the note goes into each one's audit entry",
                if n == 1 { "" } else { "s" },
                plan.skipped.len()
            )));
            if plan.key == BulkKey::Resolve {
                lines.push(choice_line(f.choice, focus(0), t));
                let needs = match f.choice {
                    None => "no decision yet: ←/→ to choose (nothing is pre-selected)",
                    Some(0) => "succeeded needs each operation's own receipt id: resolve those one at a time",
                    Some(1) => "failed: no effect happened, for every one; needs a note",
                    _ => "compensated: each effect was undone elsewhere; needs a note",
                };
                lines.push(Line::from(Span::styled(format!(" {needs}"), t.dim())));
            }
            let verb = match plan.key {
                BulkKey::Deny => "Deny",
                BulkKey::Resolve => "Resolve",
                BulkKey::Cancel => "Cancel",
                BulkKey::Query | BulkKey::Approve => "Act on",
            };
            format!(" {verb} {n} marked ")
        }
        FormKind::Resolve { operation_id, seen_version, last_query, unaskable, terms, found } => {
            lines.push(Line::from(format!(" {operation_id} (version {seen_version})")));
            lines.push(Line::from(Span::styled(format!(" last query: {last_query}"), t.dim())));
            if let Some(terms) = terms {
                lines.push(Line::from(Span::styled(format!(" amount: {terms}"), t.dim())));
            }
            // The receipt the queries found, whole: it is what to check.
            for part in found.iter().flat_map(|r| wrap_hanging(&format!("found: {r}"), 72, 7)) {
                lines.push(Line::from(Span::styled(format!(" {part}"), t.warn())));
            }
            let choices = ["succeeded", "failed", "compensated"];
            let mut spans = vec![Span::styled(" resolve as  ", focus(0))];
            for (i, c) in choices.iter().enumerate() {
                let s = if Some(i) == f.choice { t.accent().add_modifier(Modifier::REVERSED) } else { t.dim() };
                spans.push(Span::styled(format!(" {c} "), s));
                spans.push(Span::raw(" "));
            }
            lines.push(Line::from(spans));
            let needs = match f.choice {
                None => "no decision yet: ←/→ to choose (nothing is pre-selected)",
                Some(0) => "succeeded: the effect happened; needs the receipt id and a note",
                Some(1) if *unaskable => {
                    "failed: this downstream cannot be asked; you state no evidence either way, and a note"
                }
                Some(1) => "failed: no effect happened; needs a note",
                _ => "compensated: the effect was undone elsewhere; needs a note",
            };
            lines.push(Line::from(Span::styled(format!(" {needs}"), t.dim())));
            if f.choice == Some(0) {
                lines.push(Line::from(vec![
                    Span::styled(" receipt id  ", focus(1)),
                    Span::raw(format!("{}{}", f.evidence, caret(1))),
                ]));
            }
            " Resolve operation (human decision) ".to_string()
        }
    };
    lines.push(Line::from(vec![Span::styled(" note        ", focus(2)), Span::raw(format!("{}{}", f.note, caret(2)))]));
    if let Some(e) = &f.error {
        lines.push(Line::from(Span::styled(format!(" {e}"), t.bad())));
    }
    lines.push(Line::from(Span::styled(" Tab: next field · ←/→: choice · Enter: review · Esc: cancel", t.dim())));
    let area = centered(frame.area(), 76, lines.len() as u16 + 2);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(super::escaped(lines))
            .block(Block::default().borders(Borders::ALL).title(Span::styled(title, t.accent()))),
        area,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, width: usize, indent: usize, expect: &[&str]) {
        assert_eq!(wrap_hanging(text, width, indent), expect);
    }

    #[test]
    fn evidence_wraps_under_its_value_column_and_long_words_are_cut() {
        check("operation   op_1", 40, 12, &["operation   op_1"]);
        check("breaks      one two three four", 24, 12, &["breaks      one two", "            three four"]);
        check("hash        0123456789abcdef0123", 22, 12, &["hash        0123456789", "            abcdef0123"]);
        check("", 20, 2, &[""]);
        check("a b", 20, 2, &["a b"]);
    }
}
