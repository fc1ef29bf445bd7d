//! The pane tables, one function per pane. Each shows only the fetched (visible)
//! page.

use ratatui::layout::{Constraint, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};

use crate::store::OutboxState;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table, TableState, Wrap};
use ratatui::Frame;

use super::Theme;
use crate::engine::clock::rfc3339;
use crate::tui::app::{App, Pane, Rows};
use crate::tui::format::{duration_in, human_ms, short};

/// Draws the current pane.
/// Draws the current pane; returns how far it can scroll (the walkthrough's
/// steps below 120 columns; 0 for a table, which pages instead).
pub fn render(app: &App, frame: &mut Frame, area: Rect, t: Theme) -> u16 {
    match app.pane {
        Pane::Live => live(app, frame, area, t),
        Pane::Ledger => ledger(app, frame, area, t),
        Pane::Approvals => approvals(app, frame, area, t),
        Pane::Unknown => unknown(app, frame, area, t),
        Pane::Audit => audit(app, frame, area, t),
        Pane::Walkthrough => return walkthrough(app, frame, area, t),
        Pane::Metrics => super::metrics::render(app, frame, area, t),
    }
    0
}

/// Columns needed by the kept ones, with the spacing between them.
fn need(widths: &[Constraint], keep: &[bool]) -> u16 {
    let cols: Vec<u16> = widths
        .iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|(c, _)| match c {
            Constraint::Length(n) | Constraint::Min(n) => *n,
            _ => 1,
        })
        .collect();
    cols.iter().sum::<u16>() + cols.len().saturating_sub(1) as u16
}

/// Which columns are shown at `width`: columns drop in `drop_first` order until the rest fit.
fn kept(widths: &[Constraint], width: u16, drop_first: &[usize]) -> Vec<bool> {
    let mut keep = vec![true; widths.len()];
    for &i in drop_first {
        if need(widths, &keep) <= width {
            break;
        }
        if let Some(k) = keep.get_mut(i) {
            *k = false;
        }
    }
    keep
}

/// Columns left over at `width` once the kept columns have theirs: a wide
/// terminal gives them to the pane's text that would be cut.
fn spare(widths: &[Constraint], width: u16, drop_first: &[usize]) -> u16 {
    width.saturating_sub(need(widths, &kept(widths, width, drop_first)))
}

/// Ids in full: `op_` or `apr_` and 24 hex digits.
const ID_FULL: u16 = 28;
/// Ids at their narrowest (`op_0123456789…`).
const ID_NARROW: u16 = 16;

/// Widens the id column `col` (16 wide) into the room the kept columns leave,
/// up to a whole id; from 140 columns ids are whole, and the pane's
/// lowest-priority columns give way for them. Returns its width.
fn widen_id(widths: &mut [Constraint], width: u16, drop_first: &[usize], col: usize) -> usize {
    let w = if width >= 140 {
        ID_FULL
    } else {
        let keep = kept(widths, width, drop_first);
        ID_NARROW + width.saturating_sub(need(widths, &keep)).min(ID_FULL - ID_NARROW)
    };
    if let Some(c) = widths.get_mut(col) {
        *c = Constraint::Length(w);
    }
    usize::from(w)
}

/// A pane's table. When the columns do not fit `width`, the columns named in
/// `drop_first` are left out, in that order, until they do: an 80-column
/// terminal shows fewer columns with whole headers rather than every column cut.
#[allow(clippy::too_many_arguments)]
fn table<'a>(
    app: &App,
    title: &str,
    header: Vec<&'a str>,
    rows: Vec<Vec<Cell<'a>>>,
    widths: Vec<Constraint>,
    width: u16,
    drop_first: &[usize],
    t: Theme,
) -> (Table<'a>, TableState) {
    let keep = kept(&widths, width, drop_first);
    let pick = |v: Vec<Cell<'a>>| -> Row<'a> {
        Row::new(v.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(c, _)| c).collect::<Vec<_>>())
    };
    // The sort column's header carries the direction; the title names it too,
    // also when that column is left out at this width.
    let sort = app.sort_label();
    let marks = |h: &str| {
        app.sort_column().is_some_and(|c| h == c || h.starts_with(&format!("{c} ")) || (h == "#" && c == "seq"))
    };
    let arrow = if app.order().desc { "↓" } else { "↑" };
    let header: Vec<String> = header
        .into_iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(h, _)| if marks(h) { format!("{h} {arrow}") } else { h.to_string() })
        .collect();
    let widths: Vec<Constraint> = widths.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(w, _)| w).collect();
    let rows: Vec<Row<'a>> = rows.into_iter().map(pick).collect();
    let empty = rows.is_empty();
    let page = page_label(app);
    let tail = format!("{page}{} ", sort.map(|l| format!(" · sort {l}")).unwrap_or_default());
    // The title gives way first: the page and the sort stay readable at any width.
    let room = usize::from(width).saturating_sub(tail.chars().count() + 4);
    let title = format!(" {}{tail}", crate::display::clip(title, room));
    let table = Table::new(rows, widths)
        .header(Row::new(header).style(t.dim()))
        .block(Block::default().borders(Borders::TOP).title(Span::styled(title, t.accent())))
        .row_highlight_style(t.selected())
        .column_spacing(1);
    let mut state = TableState::default();
    if !empty {
        state.select(Some(app.selected));
    }
    (table, state)
}

/// ` · page k of n` (or ` · page k` when the list's total is not known, and
/// nothing on the only page).
fn page_label(app: &App) -> String {
    let k = app.page_stack.len() + 1;
    let per = app.visible_rows().max(1);
    match app.pane_total() {
        Some(total) if total > per => format!(" · page {k} of {}", (total + per - 1) / per),
        _ if k > 1 => format!(" · page {k}"),
        _ => String::new(),
    }
}

/// A pane's row count for its title: `15 of 25` when the page shows part of
/// the whole list, else the count.
fn shown_of(app: &App, shown: usize) -> String {
    match app.pane_total() {
        Some(total) if total > shown as i64 => format!("{shown} of {total}"),
        _ => shown.to_string(),
    }
}

/// An id cell `w` columns wide (`…` when cut): a marked row's id starts with `*`.
fn id_cell<'a>(app: &App, id: &str, w: usize, t: Theme) -> Cell<'a> {
    if app.marks.is_empty() || !app.is_marked(id) {
        Cell::from(short(id, w))
    } else {
        Cell::from(Span::styled(
            format!("*{}", short(id, w.saturating_sub(1))),
            t.warn().add_modifier(ratatui::style::Modifier::BOLD),
        ))
    }
}

/// The note over an empty table; with a filter set, it says the filter hides the rows.
fn empty_note(app: &App, frame: &mut Frame, area: Rect, text: &str, t: Theme) {
    let filtered;
    let text = if app.filter.is_empty() {
        text
    } else {
        filtered = format!("no row matches the filter {:?} (Esc or / then Enter to clear it)", short(&app.filter, 30));
        &filtered
    };
    if area.height > 3 {
        let inner = Rect { x: area.x + 2, y: area.y + 2, width: area.width.saturating_sub(4), height: 1 };
        frame.render_widget(Paragraph::new(Span::styled(text.to_string(), t.dim())), inner);
    }
}

fn live(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let Rows::Live(rows) = &app.rows else {
        return loading(app, frame, area, "Live operations", t);
    };
    let now = app.now_ms;
    let mut widths = vec![
        Constraint::Length(16),
        Constraint::Length(14),
        // accepted / in_flight.
        Constraint::Length(10),
        Constraint::Length(7),
        // "expired", "12m03s".
        Constraint::Length(7),
        // "overdue 12m03s" whole; at 80 columns the kept ones fit exactly.
        Constraint::Length(14),
        Constraint::Length(22),
        Constraint::Length(14),
        Constraint::Length(14),
    ];
    let id_w = widen_id(&mut widths, area.width, &[7, 6, 3], 0);
    let body: Vec<Vec<Cell>> = rows
        .iter()
        .map(|r| {
            let lease = match (r.outbox_state, r.lease_until) {
                (OutboxState::Leased, Some(u)) if u > now => Cell::from(human_ms(u.saturating_sub(now))),
                (OutboxState::Leased, Some(_)) => Cell::from(Span::styled("expired", t.bad())),
                _ => Cell::from("-"),
            };
            let next = if r.outbox_state == OutboxState::Pending {
                crate::display::countdown(r.available_at.saturating_sub(now))
            } else {
                "-".into()
            };
            vec![
                id_cell(app, &r.operation_id, id_w, t),
                Cell::from(short(&r.tool, 14)),
                Cell::from(Span::styled(short(r.state.as_str(), 10), t.state(r.state))),
                // The operation's attempts so far; `max_attempts` caps one
                // call's automatic retries, not the operation (detail says so).
                Cell::from(r.attempt.to_string()),
                lease,
                Cell::from(next),
                Cell::from(short(r.last_code.as_deref().unwrap_or("-"), 22)),
                Cell::from(short(r.lease_owner.as_deref().unwrap_or("-"), 14)),
                Cell::from(crate::display::countdown(r.deadline_at.saturating_sub(now))),
            ]
        })
        .collect();
    let (tb, mut st) = table(
        app,
        &format!("Live operations: in-flight and waiting attempts ({})", rows.len()),
        vec!["operation", "tool", "state", "attempt", "lease", "next retry", "last code", "worker", "deadline"],
        body,
        widths,
        area.width,
        &[7, 6, 3],
        t,
    );
    frame.render_stateful_widget(tb, area, &mut st);
    if rows.is_empty() {
        empty_note(app, frame, area, "nothing in flight: every accepted operation has settled", t);
    }
}

fn ledger(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let Rows::Ops(rows) = &app.rows else {
        return loading(app, frame, area, "Idempotency ledger", t);
    };
    let now = app.now_ms;
    let mut widths = vec![
        Constraint::Length(16),
        // The header "scope tenant/subject" whole (20).
        Constraint::Length(20),
        Constraint::Length(15),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(12),
        Constraint::Length(22),
        Constraint::Length(8),
    ];
    let id_w = widen_id(&mut widths, area.width, &[3, 1, 4], 0);
    // Room left over goes to the result ref / code (a code cut at 22 otherwise).
    let result_w = 22 + spare(&widths, area.width, &[3, 1, 4]).min(26);
    widths[6] = Constraint::Length(result_w);
    let result_w = usize::from(result_w);
    let body: Vec<Vec<Cell>> = rows
        .iter()
        .map(|o| {
            vec![
                id_cell(app, &o.id, id_w, t),
                Cell::from(format!("{}/{}", short(&o.tenant, 8), short(&o.subject, 11))),
                Cell::from(short(&o.tool, 15)),
                Cell::from(crate::display::digest(&o.key_sha256, 8)),
                Cell::from(crate::display::digest(&o.request_sha256, 8)),
                Cell::from(Span::styled(short(o.state.as_str(), 12), t.state(o.state))),
                Cell::from(short(o.receipt_id.as_deref().or(o.code.as_deref()).unwrap_or("-"), result_w)),
                // Retention runs from the moment an operation settled; until
                // then it is kept. One a person acted on is never purged.
                Cell::from(o.terminal_at.filter(|_| !app.acted_on.contains(&o.id)).map_or_else(
                    || if o.terminal_at.is_some() { "always".to_string() } else { "-".to_string() },
                    // Past it, the row waits for the purge.
                    |_| {
                        let left = o.expires_at.saturating_sub(now);
                        if left <= 0 {
                            "expired".to_string()
                        } else {
                            duration_in(left, 8)
                        }
                    },
                )),
            ]
        })
        .collect();
    let (tb, mut st) = table(
        app,
        &format!("Idempotency ledger ({})", shown_of(app, rows.len())),
        vec!["operation", "scope tenant/subject", "tool", "key#", "digest", "state", "result ref / code", "kept"],
        body,
        widths,
        area.width,
        &[3, 1, 4],
        t,
    );
    frame.render_stateful_widget(tb, area, &mut st);
    if rows.is_empty() {
        empty_note(app, frame, area, "no operations match", t);
    }
}

fn approvals(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let Rows::Approvals(rows) = &app.rows else {
        return loading(app, frame, area, "Pending approvals", t);
    };
    let now = app.now_ms;
    let mut widths = vec![
        Constraint::Length(16),
        Constraint::Length(15),
        Constraint::Length(8),
        Constraint::Length(12),
        Constraint::Length(16),
        Constraint::Length(8),
        Constraint::Length(10),
    ];
    let id_w = widen_id(&mut widths, area.width, &[5, 3], 0);
    let body: Vec<Vec<Cell>> = rows
        .iter()
        .map(|a| {
            let left = a.expires_at.saturating_sub(now);
            let exp_style = if left < 60_000 { t.bad() } else { Style::default() };
            let exp = if left <= 0 { "expired".to_string() } else { human_ms(left) };
            vec![
                id_cell(app, &a.id, id_w, t),
                Cell::from(short(&a.tool, 15)),
                Cell::from(short(&a.tenant, 8)),
                Cell::from(short(&a.subject, 12)),
                // From the bound, digest-checked request: never the copy beside it.
                Cell::from(crate::tui::format::approval_money(a).unwrap_or_else(|| "-".into())),
                Cell::from(crate::display::digest(&a.request_sha256, 8)),
                Cell::from(Span::styled(exp, exp_style)),
            ]
        })
        .collect();
    let (tb, mut st) = table(
        app,
        &{
            // Expiry is exclusive: a request at or past it no longer counts as pending.
            let expired = rows.iter().filter(|a| app.now_ms >= a.expires_at).count();
            if expired == 0 {
                format!("Pending approvals ({})", shown_of(app, rows.len()))
            } else {
                format!(
                    "Pending approvals ({}; {expired} expired, shown until the agent asks again)",
                    rows.len() - expired
                )
            }
        },
        vec!["approval", "tool", "tenant", "requester", "amount", "digest", "expires in"],
        body,
        widths,
        area.width,
        &[5, 3],
        t,
    );
    frame.render_stateful_widget(tb, area, &mut st);
    if rows.is_empty() {
        empty_note(app, frame, area, "no approval is waiting", t);
    }
}

fn unknown(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let Rows::Ops(rows) = &app.rows else {
        return loading(app, frame, area, "Outcome unknown", t);
    };
    let since_w: u16 = if area.width < 140 { 7 } else { 8 };
    let now = app.now_ms;
    let mut widths = vec![
        Constraint::Length(16),
        Constraint::Length(15),
        Constraint::Length(12),
        // `339d 13h` whole; below 140 columns `339d` (no other column gives way).
        Constraint::Length(since_w),
        Constraint::Length(26),
        Constraint::Length(18),
        Constraint::Length(14),
        Constraint::Min(20),
    ];
    let id_w = widen_id(&mut widths, area.width, &[6, 5, 7, 1], 0);
    // Room left over goes to the status_ref (68 characters whole).
    let ref_w = 14 + spare(&widths, area.width, &[6, 5, 7, 1]).min(54);
    widths[6] = Constraint::Length(ref_w);
    let ref_w = usize::from(ref_w);
    let body: Vec<Vec<Cell>> = rows
        .iter()
        .map(|o| {
            let last = match (&o.last_query_result, o.last_query_at) {
                (Some(r), Some(at)) => format!("{r}, {} ago", human_ms(now.saturating_sub(at))),
                _ => "never queried".into(),
            };
            vec![
                id_cell(app, &o.id, id_w, t),
                Cell::from(short(&o.tool, 15)),
                Cell::from(Span::styled(short(o.state.as_str(), 12), t.state(o.state))),
                // Since it entered this state: a query that changes nothing does not reset it.
                Cell::from(duration_in(
                    now.saturating_sub(o.state_since.unwrap_or(o.updated_at)),
                    usize::from(since_w),
                )),
                // Why it is stuck and the key that moves it (the detail says it in full).
                Cell::from(Span::styled(crate::tui::app::reason(o), t.warn())),
                Cell::from(short(o.code.as_deref().unwrap_or("-"), 18)),
                Cell::from(short(&o.status_ref, ref_w)),
                Cell::from(short(&last, 26)),
            ]
        })
        .collect();
    let (tb, mut st) = table(
        app,
        &format!("Outcome unknown: leaves only by a status query or a human decision ({})", shown_of(app, rows.len())),
        vec!["operation", "tool", "state", "since", "why", "code", "status_ref", "last query"],
        body,
        widths,
        area.width,
        &[6, 5, 7, 1],
        t,
    );
    frame.render_stateful_widget(tb, area, &mut st);
    if rows.is_empty() {
        empty_note(app, frame, area, "the queue is empty: no operation waits for a status query or review", t);
    }
}

fn audit(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let Rows::Audit(rows) = &app.rows else {
        return loading(app, frame, area, "Operator log", t);
    };
    let mut widths = vec![
        Constraint::Length(5),
        Constraint::Length(16),
        Constraint::Length(16),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(16),
        Constraint::Min(20),
    ];
    let id_w = widen_id(&mut widths, area.width, &[0, 4], 5);
    // Actors are ids too (a provider subject, `pr_…`).
    let actor_w = widen_id(&mut widths, area.width, &[0, 4], 2);
    // Where the result column does not fit (80 columns), the action says it:
    // a refused action is marked and coloured, never shown like an applied one.
    let result_shown = kept(&widths, area.width, &[0, 4]).get(4).copied().unwrap_or(true);
    // The reason takes what is left of the line (it was cut at 40 with room to spare).
    let reason_w = usize::from(20 + spare(&widths, area.width, &[0, 4]));
    let body: Vec<Vec<Cell>> = rows
        .iter()
        .map(|r| {
            let res = if r.result == "applied" { t.ok() } else { t.bad() };
            let action = if result_shown || r.result == "applied" {
                Cell::from(short(&r.action, 8))
            } else {
                Cell::from(Span::styled(short(&format!("✗{}", r.action), 8), res))
            };
            vec![
                Cell::from(r.seq.to_string()),
                Cell::from(when(r.at, app.now_ms)),
                Cell::from(short(&r.actor, actor_w)),
                action,
                Cell::from(Span::styled(short(&r.result, 8), res)),
                Cell::from(short(r.operation_id.as_deref().or(r.approval_id.as_deref()).unwrap_or("-"), id_w)),
                Cell::from(short(&r.reason, reason_w)),
            ]
        })
        .collect();
    let (tb, mut st) = table(
        app,
        "Operator log (append-only)",
        vec!["#", "time (UTC)", "actor", "action", "result", "target", "reason"],
        body,
        widths,
        area.width,
        &[0, 4],
        t,
    );
    frame.render_stateful_widget(tb, area, &mut st);
    if rows.is_empty() {
        empty_note(app, frame, area, "no operator action yet", t);
    }
}

/// A time in the operator log: the time of day when it is today (UTC), the
/// date and minute when it is not.
fn when(at: i64, now: i64) -> String {
    let stamp = rfc3339(at);
    if at.div_euclid(86_400_000) == now.div_euclid(86_400_000) {
        stamp.chars().skip(11).take(12).collect()
    } else {
        stamp.chars().take(16).collect::<String>().replace('T', " ")
    }
}

/// Below 120 columns the steps' table does not fit: each step is a few lines
/// instead (action and verdict; transition, retryable, effects; what the user
/// sees, wrapped), scrolled with j/k (the newest step in view as steps run).
fn walk_steps(app: &App, frame: &mut Frame, area: Rect, t: Theme) -> u16 {
    let w = &app.walkthrough;
    let room = usize::from(area.width.saturating_sub(11)).max(20);
    let mut lines: Vec<Line> = Vec::new();
    for s in &w.steps {
        let v = if s.verdict == "PASS" { t.ok() } else { t.bad() };
        lines.push(Line::from(vec![
            Span::styled(format!(" {:>2}  ", s.n), t.accent()),
            Span::raw(format!("{}  ", short(&s.action, room))),
            Span::styled(s.verdict.clone(), v),
        ]));
        lines.push(Line::from(Span::styled(
            format!(
                "     {} · retryable {} · effects {}",
                short(&s.transition, room),
                short(&s.retryable, 9),
                s.effects
            ),
            t.dim(),
        )));
        for (i, part) in super::lab::wrap(&crate::display::escape(&s.user_sees), room).into_iter().enumerate() {
            let label = if i == 0 { "sees" } else { "" };
            lines.push(Line::from(vec![Span::styled(format!("     {label:<5} "), t.dim()), Span::raw(part)]));
        }
    }
    if lines.is_empty() {
        lines.push(Line::from(Span::styled("  no step yet: n runs the first", t.dim())));
    }
    let block = Block::default().borders(Borders::TOP);
    let inner = block.inner(area);
    let extent = (lines.len() as u16).saturating_sub(inner.height);
    let scroll = app.walk_scroll.min(extent);
    let title = if extent == 0 { String::new() } else { format!(" steps · j/k scroll {scroll}/{extent} ") };
    frame.render_widget(
        Paragraph::new(super::escaped(lines)).block(block.title(Span::styled(title, t.dim()))).scroll((scroll, 0)),
        area,
    );
    extent
}

fn walkthrough(app: &App, frame: &mut Frame, area: Rect, t: Theme) -> u16 {
    let w = &app.walkthrough;
    if w.scenarios.is_empty() {
        let p = Paragraph::new(vec![
            Line::from(Span::styled(" Scenario walkthrough ", t.accent())),
            Line::from(""),
            Line::from(Span::styled("  loading scenarios…", t.dim())),
        ]);
        frame.render_widget(p, area);
        return 0;
    }
    let (num, title) = w.scenarios.get(w.selected).cloned().unwrap_or_default();
    let mut lines = vec![
        Line::from(vec![
            Span::styled(format!(" Scenario {num}: {title} "), t.accent()),
            Span::styled(format!("  ({} of {}, [ ] to choose)", w.selected + 1, w.scenarios.len()), t.dim()),
        ]),
        Line::from(Span::styled(format!(" {}", w.crash_note), t.dim())),
    ];
    if w.more {
        lines.push(Line::from(Span::styled(" press n for the next step", t.dim())));
    } else {
        lines.push(Line::from(Span::styled(" finished: [ ] for another scenario", t.dim())));
    }
    // The crash note wraps at 80 columns: the top grows so the key hint stays.
    let top_text = Paragraph::new(lines).wrap(Wrap { trim: false });
    let top_h = u16::try_from(top_text.line_count(area.width)).unwrap_or(3).clamp(3, 6);
    let [top, rest] = ratatui::layout::Layout::vertical([Constraint::Length(top_h), Constraint::Min(1)]).areas(area);
    frame.render_widget(top_text, top);
    if area.width < 120 {
        return walk_steps(app, frame, rest, t);
    }
    let body: Vec<Row> = w
        .steps
        .iter()
        .map(|s| {
            let v = if s.verdict == "PASS" { t.ok() } else { t.bad() };
            Row::new(vec![
                Cell::from(s.n.to_string()),
                Cell::from(short(&s.action, 22)),
                Cell::from(short(&s.transition, 26)),
                Cell::from(s.retryable.clone()),
                Cell::from(short(&s.user_sees, 44)),
                Cell::from(s.effects.to_string()),
                Cell::from(Span::styled(s.verdict.clone(), v)),
            ])
        })
        .collect();
    let n = body.len();
    let tb = Table::new(
        body,
        vec![
            Constraint::Length(3),
            Constraint::Length(22),
            Constraint::Length(26),
            Constraint::Length(9),
            Constraint::Min(20),
            Constraint::Length(7),
            Constraint::Length(4),
        ],
    )
    .header(
        Row::new(vec!["#", "action", "transition", "retryable", "what the user sees", "effects", ""]).style(t.dim()),
    )
    .block(Block::default().borders(Borders::TOP))
    .column_spacing(1);
    let mut st = TableState::default();
    if n > 0 {
        st.select(Some(n - 1));
    }
    frame.render_stateful_widget(tb, rest, &mut st);
    0
}

fn loading(app: &App, frame: &mut Frame, area: Rect, title: &str, t: Theme) {
    let _ = app;
    let p = Paragraph::new(vec![
        Line::from(Span::styled(format!(" {title} "), t.accent())),
        Line::from(""),
        Line::from(Span::styled("  loading…", t.dim())),
    ]);
    frame.render_widget(p, area);
}
