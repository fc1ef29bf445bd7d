//! The lab panel (`L`): which defense is off, the rule it breaks, what to watch,
//! and the harm counted so far. A pure function of the app, like every screen.

use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph};
use ratatui::Frame;

use super::Theme;
use crate::engine::{LabSide, LabToggle};
use crate::tui::app::{percent, App};

/// Words of `text` in lines at most `width` cells wide (a word longer than that
/// gets a line of its own).
pub(super) fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let fits = Span::raw(format!("{line} {word}")).width() <= width;
        if line.is_empty() {
            line = word.to_string();
        } else if fits {
            line.push(' ');
            line.push_str(word);
        } else {
            out.push(std::mem::take(&mut line));
            line = word.to_string();
        }
    }
    out.push(line);
    out
}

fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let [v] = Layout::vertical([Constraint::Length(h.min(area.height))]).flex(Flex::Center).areas(area);
    let [c] = Layout::horizontal([Constraint::Length(w.min(area.width))]).flex(Flex::Center).areas(v);
    c
}

/// Draws the lab panel over the console.
pub fn render(app: &App, frame: &mut Frame, t: Theme) {
    let lab = &app.lab;
    let width = frame.area().width.min(100);
    // Inside the border, after the 15-cell field names.
    let text_width = usize::from(width.saturating_sub(2 + 15)).max(20);
    let mut lines: Vec<Line> = Vec::new();
    let state = match (lab.demo, lab.toggle) {
        (false, _) => Span::styled("not a demo database: toggles refused (LAB_NOT_DEMO)", t.warn()),
        (true, None) => Span::styled("every defense on", t.ok()),
        (true, Some(x)) => Span::styled(format!("DEFENSE OFF: {}", x.as_str()), t.bad()),
    };
    lines.push(Line::from(vec![
        Span::raw(" "),
        state,
        Span::styled("   faults ", t.dim()),
        Span::raw(percent(lab.fault_bp)),
    ]));
    lines.push(Line::from(""));
    let chosen = LabToggle::ALL[app.lab_selected.min(LabToggle::ALL.len() - 1)];
    for x in LabToggle::ALL {
        let mark = if lab.toggle == Some(x) { "[off]" } else { "[ on]" };
        let side = match x.side() {
            LabSide::Engine => "engine ",
            LabSide::Harness => "harness",
        };
        let row = format!(" {} {mark} {:<28} {side}", if x == chosen { ">" } else { " " }, x.as_str());
        let style = match (x == chosen, lab.toggle == Some(x)) {
            (true, _) => t.accent().add_modifier(Modifier::REVERSED),
            (false, true) => t.bad(),
            (false, false) if lab.demo => ratatui::style::Style::default(),
            (false, false) => t.dim(),
        };
        lines.push(Line::from(Span::styled(row, style)));
    }
    lines.push(Line::from(""));
    for (name, text) in
        [("rule broken", chosen.rule()), ("what to watch", chosen.harm()), ("source text", chosen.keel())]
    {
        for (i, part) in wrap(text, text_width).into_iter().enumerate() {
            let label = if i == 0 { name } else { "" };
            lines.push(Line::from(vec![Span::styled(format!(" {label:<13} "), t.dim()), Span::raw(part)]));
        }
    }
    lines.push(Line::from(""));
    let dups = app.header.side_effect_duplicates;
    let harm = vec![
        Span::styled(" duplicate effects ", t.dim()),
        Span::styled(format!(" {dups} "), if dups == 0 { t.ok() } else { t.bad() }.add_modifier(Modifier::REVERSED)),
        Span::styled("   masked conflicts ", t.dim()),
        Span::raw(lab.masked_conflicts.to_string()),
    ];
    lines.push(Line::from(harm));
    if let Some(a) = &lab.agents {
        let wrong = a.masked_conflicts + a.replay_mismatches + a.wrong_beliefs;
        lines.push(Line::from(vec![
            Span::styled(" agents here: ", t.dim()),
            Span::raw(format!("{} intents  ", a.intents)),
            Span::styled(format!("{wrong} silently wrong"), if wrong == 0 { t.ok() } else { t.bad() }),
            Span::styled(
                format!(
                    " (conflicts {}, replays {}, beliefs {})",
                    a.masked_conflicts, a.replay_mismatches, a.wrong_beliefs
                ),
                t.dim(),
            ),
        ]));
    }
    let keys = if app.read_only {
        "j/k: choose · Esc: close · read-only: switching is disabled"
    } else if lab.demo {
        "j/k: choose · Enter: switch it off · o: every defense on · f: fault rate · Esc: close"
    } else {
        "j/k: read about each · f: fault rate · Esc: close"
    };
    // Wrapped inside the border: at 80 columns the line does not fit whole.
    for part in wrap(keys, usize::from(width.saturating_sub(3))) {
        lines.push(Line::from(Span::styled(format!(" {part}"), t.dim())));
    }
    let area = centered(frame.area(), width, lines.len() as u16 + 2);
    frame.render_widget(Clear, area);
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(" Lab: defenses off, one at a time (demo databases only) ", t.accent())),
        ),
        area,
    );
}
