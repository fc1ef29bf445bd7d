//! Popups: help (generated from the keymap), confirm dialogs (default Cancel,
//! with the evidence), and the resolve / deny forms.

use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::Theme;
use crate::tui::app::{App, FormKind, Mode};
use crate::tui::keymap;

fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let [v] = Layout::vertical([Constraint::Length(h.min(area.height))]).flex(Flex::Center).areas(area);
    let [c] = Layout::horizontal([Constraint::Length(w.min(area.width))]).flex(Flex::Center).areas(v);
    c
}

/// The help overlay for the mode help was opened from.
pub fn help(app: &App, frame: &mut Frame, t: Theme) {
    let lines_for = keymap::help_lines(app.help_return, app.read_only);
    let mut lines: Vec<Line> = lines_for
        .iter()
        .map(|(k, h)| Line::from(vec![Span::styled(format!(" {k:<26}"), t.accent()), Span::raw((*h).to_string())]))
        .collect();
    if app.read_only {
        lines.push(Line::from(Span::styled(" read-only: state-changing keys are hidden", t.warn())));
    }
    let h = (lines.len() as u16 + 2).min(frame.area().height);
    let area = centered(frame.area(), 90, h);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" Keys (? or Esc to close) ")),
        area,
    );
}

fn buttons(on_confirm: bool, t: Theme) -> Line<'static> {
    let b = |label: &str, focused: bool| {
        let style = if focused { t.accent().add_modifier(Modifier::REVERSED) } else { t.dim() };
        Span::styled(format!("[ {label} ]"), style)
    };
    Line::from(vec![Span::raw("   "), b("Cancel", !on_confirm), Span::raw("   "), b("Confirm", on_confirm)])
}

/// A confirm dialog.
pub fn confirm(app: &App, frame: &mut Frame, t: Theme) {
    let Some(c) = &app.confirm else { return };
    let mut lines: Vec<Line> = c.evidence.iter().map(|e| Line::from(format!(" {e}"))).collect();
    lines.push(Line::from(""));
    lines.push(buttons(c.on_confirm, t));
    let area = centered(frame.area(), 76, lines.len() as u16 + 2);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(super::escaped(lines))
            .wrap(Wrap { trim: false })
            .block(Block::default().borders(Borders::ALL).title(Span::styled(format!(" {} ", c.title), t.accent()))),
        area,
    );
}

/// The resolve / deny / cancel form.
pub fn form(app: &App, frame: &mut Frame, t: Theme) {
    let Some(f) = &app.form else { return };
    let focus = |i: usize| if f.field == i && app.mode == Mode::Form { t.accent() } else { t.dim() };
    let caret = |i: usize| if f.field == i { "▏" } else { "" };
    let mut lines = Vec::new();
    let title = match &f.kind {
        FormKind::Deny { approval_id } => {
            lines.push(Line::from(format!(" deny {approval_id}")));
            " Deny approval ".to_string()
        }
        FormKind::Cancel { operation_id, state, .. } => {
            lines.push(Line::from(format!(" cancel {operation_id} ({state})")));
            " Cancel operation ".to_string()
        }
        FormKind::Resolve { operation_id, seen_version, last_query } => {
            lines.push(Line::from(format!(" {operation_id} (version {seen_version})")));
            lines.push(Line::from(Span::styled(format!(" last query: {last_query}"), t.dim())));
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
