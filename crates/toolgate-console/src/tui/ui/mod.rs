//! Rendering: a pure function of [`App`] (no I/O, no engine calls).

mod detail;
mod lab;
mod metrics;
mod panes;
mod popups;

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Tabs};
use ratatui::Frame;

use super::app::{App, Mode, Pane};
use super::format::{human_ms, time_of_day};
use crate::store::OpState;

/// Colours, or their absence (NO_COLOR).
#[derive(Debug, Clone, Copy)]
pub struct Theme {
    mono: bool,
}

impl Theme {
    /// The theme for an app.
    pub fn of(app: &App) -> Self {
        Self { mono: app.no_color }
    }
    fn fg(self, c: Color) -> Style {
        if self.mono {
            Style::default()
        } else {
            Style::default().fg(c)
        }
    }
    /// Good news.
    pub fn ok(self) -> Style {
        self.fg(Color::Green)
    }
    /// Bad news (bold even without colour).
    pub fn bad(self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }
    /// Needs attention.
    pub fn warn(self) -> Style {
        self.fg(Color::Yellow)
    }
    /// Secondary text.
    pub fn dim(self) -> Style {
        if self.mono {
            Style::default()
        } else {
            Style::default().fg(Color::DarkGray)
        }
    }
    /// Titles and keys.
    pub fn accent(self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }
    /// The selected row.
    pub fn selected(self) -> Style {
        Style::default().add_modifier(Modifier::REVERSED)
    }
    /// A ledger state's style.
    pub fn state(self, s: OpState) -> Style {
        match s {
            OpState::Succeeded | OpState::Resolved => self.ok(),
            OpState::Unknown | OpState::NeedsReview => self.bad(),
            OpState::Failed => self.warn(),
            OpState::InFlight | OpState::Accepted => self.fg(Color::Blue),
            OpState::Unrecognized => Style::default(),
        }
    }
}

/// Every span of `lines` with control characters written out: stored text
/// (notes, reasons, names) cannot move the cursor or fake a line.
pub fn escaped(lines: Vec<ratatui::text::Line<'_>>) -> Vec<ratatui::text::Line<'static>> {
    lines
        .into_iter()
        .map(|l| {
            let spans: Vec<Span<'static>> = l
                .spans
                .into_iter()
                .map(|s| Span::styled(crate::display::escape(&s.content).into_owned(), s.style))
                .collect();
            ratatui::text::Line::from(spans).style(l.style)
        })
        .collect()
}

pub use super::app::MIN_SIZE;

/// Draws the whole console (below [`MIN_SIZE`], only what size it needs: the
/// console comes back as soon as the terminal is large enough).
/// Returns how far the body can scroll (the detail, or the walkthrough's
/// steps; 0 when neither is on screen), which the event loop hands back to the
/// model (`Action::BodyExtent`) so `j`, `G` and PgDn stop at the end.
pub fn render(app: &App, frame: &mut Frame) -> u16 {
    let t = Theme::of(app);
    let area = frame.area();
    if area.width < MIN_SIZE.0 || area.height < MIN_SIZE.1 {
        let lines = vec![
            Line::from(Span::styled(
                format!("terminal too small: need {}×{}, have {}×{}", MIN_SIZE.0, MIN_SIZE.1, area.width, area.height),
                t.warn(),
            )),
            Line::from(Span::styled("enlarge it to continue; Q quits", t.dim())),
        ];
        frame.render_widget(Paragraph::new(lines).wrap(ratatui::widgets::Wrap { trim: true }), area);
        return 0;
    }
    let [header, tabs, body, footer] =
        Layout::vertical([Constraint::Length(3), Constraint::Length(1), Constraint::Min(3), Constraint::Length(2)])
            .areas(frame.area());
    render_header(app, frame, header, t);
    render_tabs(app, frame, tabs, t);
    // The command bar and help opened from the detail view leave it on screen.
    let over_detail = match app.mode {
        Mode::Detail => true,
        Mode::Command => app.command.return_to == Mode::Detail,
        Mode::Help => app.help.return_to == Mode::Detail,
        Mode::Confirm | Mode::Form => app.dialog.return_to == Mode::Detail,
        _ => false,
    };
    let extent = if over_detail { detail::render(app, frame, body, t) } else { panes::render(app, frame, body, t) };
    render_footer(app, frame, footer, t);
    match app.mode {
        Mode::Help => popups::help(app, frame, t),
        Mode::Confirm => popups::confirm(app, frame, t),
        Mode::Form => popups::form(app, frame, t),
        Mode::Lab => lab::render(app, frame, t),
        Mode::Command => popups::command_candidates(app, frame, footer, t),
        _ => {}
    }
    extent
}

fn render_header(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let live = match (&app.db_down, app.live) {
        (Some((_, code)), _) if code == "DB_UNAVAILABLE" => Span::styled("● DB DOWN", t.bad()),
        (Some(_), _) => Span::styled("● REFRESH FAILING", t.bad()),
        (None, true) => Span::styled("● LIVE", t.ok()),
        (None, false) => Span::styled(format!("‖ PAUSED at {}", time_of_day(app.now_ms)), t.warn()),
    };
    let mut l1 = vec![
        Span::styled("toolgate ", t.accent()),
        Span::raw(format!("{}  ", app.walkthrough.db_label.as_deref().unwrap_or(&app.db_label))),
        Span::styled("operator ", t.dim()),
        Span::raw(format!("{}  ", app.operator)),
        live,
    ];
    if app.read_only {
        l1.push(Span::styled("  READ-ONLY", t.warn()));
    }
    if app.header.clock_paused.is_some() {
        // The reason is in `toolgate clock` and the log; the header only warns.
        l1.push(Span::styled("  CLOCK: REAPER PAUSED", t.bad()));
    }
    if let Some(x) = app.lab.toggle {
        l1.push(Span::styled(format!("  LAB: {} OFF", x.as_str()), t.bad()));
    }
    // While a breaker is open no call goes to its downstream: say so up top
    // (the Metrics pane has the details).
    let half_open = if area.width < 100 { "PROBE" } else { "HALF-OPEN" };
    for (state, label) in
        [(crate::store::CircuitState::Open, "OPEN"), (crate::store::CircuitState::HalfOpen, half_open)]
    {
        let mut names: Vec<String> = Vec::new();
        for c in app.header.breakers.iter().filter(|c| c.state == state) {
            let probe = c
                .open_until
                .filter(|_| area.width >= 100)
                .map_or_else(String::new, |at| format!(" (probe {})", time_of_day(at)));
            names.push(format!("{}{probe}", super::format::short(&c.downstream, 24)));
        }
        if !names.is_empty() {
            l1.push(Span::styled(format!("  BREAKER {label}: {}", names.join(", ")), t.bad()));
        }
    }
    let count = |s: &str| app.header.by_state.iter().find(|(k, _)| k == s).map_or(0, |(_, v)| *v);
    let mut l2 = Vec::new();
    let narrow = area.width < 100;
    if let Some((since, code)) = &app.db_down {
        // The counts below are as stale as the rows: say how stale instead.
        let what = if code == "DB_UNAVAILABLE" { "DB DOWN" } else { "REFRESH FAILING" };
        let rows =
            app.rows_at.map_or_else(|| "no rows yet".to_string(), |at| format!("showing rows of {}", time_of_day(at)));
        l2.push(Span::styled(format!("● {what} since {}, {rows}", time_of_day(*since)), t.bad()));
        l2.push(Span::styled(format!("  ({code}; retrying)"), t.dim()));
    }
    for s in OpState::ALL.iter().copied() {
        if app.db_down.is_some() {
            break;
        }
        let abbr = match s {
            OpState::Accepted => "acc",
            OpState::InFlight => "flight",
            OpState::Succeeded => "ok",
            OpState::NeedsReview => "review",
            _ => s.as_str(),
        };
        l2.push(Span::styled(format!("{} ", if narrow { abbr } else { s.as_str() }), t.dim()));
        l2.push(Span::styled(format!("{}  ", count(s.as_str())), t.state(s)));
    }
    let dups = app.header.side_effect_duplicates;
    let dup_style = if dups == 0 { t.ok() } else { t.bad() };
    // At 80 columns the labels are shorter, so the active filter stays in view.
    let (dup_l, pend_l, old_l, sep) = if narrow {
        ("duplicates ", "  pending ", "  oldest ", "  ")
    } else {
        ("duplicate effects ", "   pending approvals ", "   oldest unknown ", "   ")
    };
    let mut l3 = vec![
        Span::styled(dup_l, t.dim()),
        Span::styled(format!(" {dups} "), dup_style.add_modifier(Modifier::REVERSED)),
        Span::styled(pend_l, t.dim()),
        Span::raw(app.header.pending_approvals.to_string()),
    ];
    if let Some(at) = app.header.oldest_unknown_at {
        l3.push(Span::styled(old_l, t.dim()));
        l3.push(Span::styled(human_ms(app.now_ms.saturating_sub(at)), t.bad()));
    }
    if app.lab.fault_bp > 0 {
        l3.push(Span::styled(format!("{sep}faults "), t.dim()));
        l3.push(Span::styled(crate::tui::app::percent(app.lab.fault_bp), t.warn()));
    }
    if !app.filter.is_empty() || app.mode == Mode::Filter {
        l3.push(Span::styled(format!("{sep}filter "), t.dim()));
        l3.push(Span::styled(format!("/{}", super::format::short(&app.filter, 80)), t.accent()));
        if app.mode == Mode::Filter {
            l3.push(Span::styled("▏", t.accent()));
        }
    }
    frame.render_widget(Paragraph::new(vec![Line::from(l1), Line::from(l2), Line::from(l3)]), area);
}

fn render_tabs(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    // Below 100 columns "Walkthrough" reads "Walk", so every tab fits at 80.
    let title = |p: Pane| if area.width < 100 && p == Pane::Walkthrough { "Walk" } else { p.title() };
    let titles: Vec<Line> =
        Pane::ALL.iter().enumerate().map(|(i, p)| Line::from(format!("{} {}", i + 1, title(*p)))).collect();
    let idx = Pane::ALL.iter().position(|p| *p == app.pane).unwrap_or(0);
    let tabs = Tabs::new(titles).select(idx).highlight_style(t.accent().add_modifier(Modifier::REVERSED)).divider("│");
    frame.render_widget(tabs, area);
}

fn render_footer(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    if app.mode == Mode::Command {
        let c = &app.command;
        let first = match &c.error {
            Some(e) => Line::from(Span::styled(super::format::short(e, 300), t.bad())),
            None => Line::from(Span::styled(
                "Enter run · Tab complete · Up/Down history · Esc close · :help lists commands",
                t.dim(),
            )),
        };
        // Long input scrolls: the end (where the caret is) stays visible.
        let room = usize::from(area.width.saturating_sub(2));
        let typed = super::format::short(&c.input, usize::MAX);
        let shown: String = typed.chars().skip(typed.chars().count().saturating_sub(room)).collect();
        let bar = Line::from(vec![Span::styled(":", t.accent()), Span::raw(shown), Span::styled("▏", t.accent())]);
        frame.render_widget(Paragraph::new(vec![first, bar]), area);
        return;
    }
    // The detail offers the keys that apply to its operation's state.
    let detail_keys: Vec<(&str, &str, bool)> = {
        let state = app.detail.op.as_ref().map_or(OpState::Unrecognized, |d| d.operation.state);
        let mut keys = vec![("Esc", "back", false), ("j/k", "scroll", false)];
        if state.is_in_progress() || state.is_unknown_queue() {
            keys.push(("q", "query", true));
        }
        if state.is_unknown_queue() {
            keys.push(("r", "resolve", true));
        }
        if state.is_in_progress() {
            keys.push(("c", "cancel", true));
        }
        keys.extend([
            ("F", if app.detail.follow { "stop following" } else { "follow" }, false),
            ("y", "copy id", false),
        ]);
        keys
    };
    let hints: &[(&str, &str, bool)] = match (app.mode, app.pane) {
        (Mode::Detail, _) if app.detail.approval.is_some() => {
            &[("Esc", "back", false), ("a", "approve", true), ("d", "deny", true), ("y", "copy id", false)]
        }
        (Mode::Detail, _) => &detail_keys,
        (Mode::Filter, _) => &[("Enter", "apply", false), ("Esc", "cancel", false)],
        // A dialog's own keys (the pane's do nothing while it is open).
        (Mode::Confirm, _) => {
            &[("Tab ←/→", "switch button", false), ("Enter", "choose", false), ("Esc", "go back", false)]
        }
        (Mode::Form, _) => &[
            ("Tab", "next field", false),
            ("←/→", "choice", false),
            ("Enter", "review", false),
            ("Esc", "go back", false),
        ],
        (Mode::Lab, _) => &[
            ("j/k", "choose", false),
            ("Enter", "switch off", true),
            ("o", "all on", true),
            ("f", "faults", true),
            ("Esc", "close", false),
        ],
        (_, Pane::Live | Pane::Ledger) => {
            &[("c", "cancel", true), ("Enter", "detail", false), ("/", "filter", false), ("PgDn", "page", false)]
        }
        (_, Pane::Unknown) => {
            &[("q", "query", true), ("r", "resolve", true), ("Enter", "detail", false), ("/", "filter", false)]
        }
        (_, Pane::Approvals) => {
            &[("a", "approve", true), ("d", "deny", true), ("Enter", "detail", false), ("/", "filter", false)]
        }
        (_, Pane::Walkthrough) => &[("n", "next step", false), ("[ ]", "scenario", false), ("j/k", "scroll", false)],
        _ => &[("Enter", "detail", false), ("/", "filter", false), ("PgDn", "page", false)],
    };
    let mut spans = Vec::new();
    for (k, what, changes) in hints {
        if *changes && app.read_only {
            continue;
        }
        spans.push(Span::styled(format!(" {k} "), t.accent()));
        spans.push(Span::raw(format!("{what} ")));
    }
    if matches!(app.mode, Mode::Confirm | Mode::Form) {
        // `?` and `Q` are not a dialog's keys: it is answered or left first.
        spans.push(Span::styled(" Ctrl-C ", t.accent()));
        spans.push(Span::raw("quit"));
    } else {
        spans.push(Span::styled(" ? ", t.accent()));
        spans.push(Span::raw("help "));
        spans.push(Span::styled(" Q ", t.accent()));
        spans.push(Span::raw("quit"));
    }
    let [status_area, hints_area] = Layout::vertical([Constraint::Length(1), Constraint::Length(1)]).areas(area);
    frame.render_widget(Paragraph::new(Line::from(spans)), hints_area);
    // A running bulk action: its gauge takes the status line.
    if let Some(b) = &app.bulk {
        let ratio = if b.total == 0 { 1.0 } else { b.done as f64 / b.total as f64 };
        let gauge = ratatui::widgets::LineGauge::default()
            .filled_style(t.accent())
            .label(format!("bulk {} {}/{} ", b.verb, b.done, b.total))
            .ratio(ratio.clamp(0.0, 1.0));
        frame.render_widget(gauge, status_area);
        return;
    }
    let mut line = Vec::new();
    if app.detail.follow && app.mode == Mode::Detail {
        line.push(Span::styled("[following] ", t.accent()));
    }
    if !app.marks.is_empty() {
        line.push(Span::styled(format!("[{} marked] ", app.marks.len()), t.warn().add_modifier(Modifier::BOLD)));
    }
    // What is left of the line after the markers, cut with an ellipsis (the
    // whole text is in `:messages`).
    let used: usize = line.iter().map(|s| s.content.chars().count()).sum();
    let room = usize::from(status_area.width).saturating_sub(used);
    let fit = |s: &str| -> String {
        if s.chars().count() <= room {
            s.to_string()
        } else {
            let mut cut: String = s.chars().take(room.saturating_sub(1)).collect();
            cut.push('…');
            cut
        }
    };
    match &app.status {
        Some((s, true)) => line.push(Span::styled(fit(s), t.bad())),
        Some((s, false)) => line.push(Span::styled(fit(s), t.ok())),
        None => {}
    }
    frame.render_widget(Paragraph::new(Line::from(line)), status_area);
}
