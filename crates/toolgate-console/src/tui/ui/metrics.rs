//! The metrics pane: rates over the last 15 minutes with sparklines, dispatch
//! latency p50/p95/p99 per tool, the oldest unknown operation's age and the
//! duplicate-effects counter, and beside the sparklines a resilience section: per
//! tool, the retry budget, the circuit breaker and any rate-limit cooldown.
//! Everything comes from `telemetry::metrics::snapshot`, computed from the
//! database, so every process sees the same numbers.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table};
use ratatui::Frame;

use super::Theme;
use crate::store::CircuitState;
use crate::telemetry::metrics::{MetricsSnapshot, ToolLatency, ToolResilience};
use crate::tui::app::{App, Rows};
use crate::tui::format::{human_ms, short, time_of_day, tokens};

/// One tool's resilience, as text with a style per cell.
struct Resilience {
    tool: String,
    budget: (String, Style),
    breaker: (String, Style),
    cooldown: (String, Style),
}

/// What a tool's budget, breaker and cooldown read at `now` (times of day, UTC).
fn resilience(r: &ToolResilience, now: i64, t: Theme) -> Resilience {
    let budget_style = if r.budget_milli < crate::store::MILLI_TOKEN { t.bad() } else { Style::default() };
    let probe = |at: Option<i64>| match at {
        Some(at) if at > now => format!("probe {}", time_of_day(at)),
        // The cool-down is over: the next send is the probe.
        _ => "probe due".to_string(),
    };
    let breaker = match r.circuit {
        CircuitState::Closed => ("closed".to_string(), t.ok()),
        CircuitState::Open => (
            format!(
                "open since {}, {}",
                r.open_since_ms.map_or_else(|| "?".to_string(), time_of_day),
                probe(r.next_probe_ms)
            ),
            t.bad(),
        ),
        CircuitState::HalfOpen => {
            let what = match r.next_probe_ms {
                Some(at) if at > now => format!("probe out until {}", time_of_day(at)),
                _ => "probe due".to_string(),
            };
            (format!("half-open, {what}"), t.warn())
        }
        CircuitState::Unrecognized => ("?".to_string(), t.warn()),
    };
    // A cooldown that ended since the snapshot is over: the next refresh drops it.
    let cooldown = match r.rate_limited_until_ms {
        Some(until) if r.rate_limited > 0 && until > now => {
            let ops = if r.rate_limited == 1 { "op" } else { "ops" };
            (format!("{} {ops} wait until {}", r.rate_limited, time_of_day(until)), t.warn())
        }
        _ => ("none".to_string(), t.dim()),
    };
    Resilience {
        tool: short(&r.tool, 18),
        budget: (format!("{}/{}", tokens(r.budget_milli), tokens(r.capacity_milli)), budget_style),
        breaker,
        cooldown,
    }
}

/// Column widths of the one-line-per-tool table: tool, budget, breaker, cooldown.
const RESILIENCE_WIDTHS: [u16; 4] = [18, 12, 36, 24];

/// `label` then `text`, one line per comma-separated part, each wrapped to
/// `width`; continuation lines indented under the text.
fn labelled(label: &str, text: &str, style: Style, width: usize, t: Theme) -> Vec<Line<'static>> {
    let room = width.saturating_sub(label.chars().count()).max(10);
    text.split(", ")
        .flat_map(|part| super::lab::wrap(part, room))
        .enumerate()
        .map(|(i, part)| {
            let lead = if i == 0 { label.to_string() } else { " ".repeat(label.chars().count()) };
            Line::from(vec![Span::styled(lead, t.dim()), Span::styled(part, style)])
        })
        .collect()
}

/// The resilience section in `area`: a table (one line per tool) when it fits,
/// else a few lines per tool (a rate-limit line only when one holds operations
/// back). Tools that do not fit are counted on the last line.
fn render_resilience(app: &App, tools: &[ToolResilience], frame: &mut Frame, area: Rect, t: Theme) {
    let block = Block::default().borders(Borders::TOP).title(Span::styled(" resilience (UTC) ", t.accent()));
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let height = usize::from(inner.height);
    if tools.is_empty() || height == 0 {
        frame.render_widget(Paragraph::new(Span::styled(" no tools", t.dim())), inner);
        return;
    }
    let rows: Vec<Resilience> = tools.iter().map(|r| resilience(r, app.now_ms, t)).collect();
    let table_width: u16 = RESILIENCE_WIDTHS.iter().sum::<u16>() + 4;
    let mut lines: Vec<Line> = Vec::new();
    let blocks: Vec<Vec<Line>> = if inner.width >= table_width {
        let w = RESILIENCE_WIDTHS.map(usize::from);
        lines.push(
            Line::from(format!(
                " {:<a$} {:<b$} {:<c$} {}",
                "tool",
                "retry budget",
                "breaker",
                "rate-limit cooldown",
                a = w[0],
                b = w[1],
                c = w[2]
            ))
            .style(t.dim()),
        );
        rows.iter()
            .map(|r| {
                vec![Line::from(vec![
                    Span::raw(format!(" {:<a$} ", r.tool, a = w[0])),
                    Span::styled(format!("{:<b$} ", r.budget.0, b = w[1]), r.budget.1),
                    Span::styled(format!("{:<c$} ", r.breaker.0, c = w[2]), r.breaker.1),
                    Span::styled(r.cooldown.0.clone(), r.cooldown.1),
                ])]
            })
            .collect()
    } else {
        let width = usize::from(inner.width);
        rows.iter()
            .map(|r| {
                let mut b = vec![Line::from(vec![
                    Span::raw(format!(" {}  ", r.tool)),
                    Span::styled("retries ", t.dim()),
                    Span::styled(r.budget.0.clone(), r.budget.1),
                ])];
                b.extend(labelled("   breaker ", &r.breaker.0, r.breaker.1, width, t));
                if r.cooldown.0 != "none" {
                    b.extend(labelled("   rate limit ", &r.cooldown.0, r.cooldown.1, width, t));
                }
                b
            })
            .collect()
    };
    // Whole tools only; when some do not fit, the last line counts them.
    let total = blocks.len();
    let mut room = height.saturating_sub(lines.len());
    for (i, b) in blocks.into_iter().enumerate() {
        let rest_fits = b.len() <= room;
        let is_last = i + 1 == total;
        if rest_fits && (is_last || b.len() < room) {
            room -= b.len();
            lines.extend(b);
        } else {
            lines.push(Line::from(Span::styled(format!(" … {} more: toolgate metrics", total - i), t.dim())));
            break;
        }
    }
    frame.render_widget(Paragraph::new(super::escaped(lines)), inner);
}

fn us(v: i64) -> String {
    if v >= 1_000_000 {
        format!("{:.2}s", v as f64 / 1e6)
    } else if v >= 1_000 {
        format!("{:.1}ms", v as f64 / 1e3)
    } else {
        format!("{v}µs")
    }
}

fn latency_rows(rows: &[ToolLatency]) -> Vec<Row<'static>> {
    rows.iter()
        .map(|l| {
            let (p50, p95, p99) = l
                .percentiles
                .as_ref()
                .map_or(("-".into(), "-".into(), "-".into()), |p| (us(p.p50_us), us(p.p95_us), us(p.p99_us)));
            Row::new(vec![
                Cell::from(l.tool.clone()),
                Cell::from(l.count.to_string()),
                Cell::from(p50),
                Cell::from(p95),
                Cell::from(p99),
            ])
        })
        .collect()
}

/// Latency below 120 columns: per tool the window's calls and p50/p95/p99, then
/// the all-time calls and p99.
fn render_latency_narrow(m: &MetricsSnapshot, frame: &mut Frame, area: Rect, t: Theme) {
    let p = |l: Option<&ToolLatency>, f: fn(&crate::telemetry::histogram::Percentiles) -> i64| {
        l.and_then(|l| l.percentiles.as_ref()).map_or_else(|| "-".to_string(), |p| us(f(p)))
    };
    // Every tool called, all time; the window's figures beside them.
    let rows: Vec<Row> = m
        .latency_all_time
        .iter()
        .map(|all| {
            let win = m.latency_window.iter().find(|w| w.tool == all.tool);
            Row::new(vec![
                Cell::from(short(&all.tool, 15)),
                Cell::from(win.map_or(0, |w| w.count).to_string()),
                Cell::from(p(win, |p| p.p50_us)),
                Cell::from(p(win, |p| p.p95_us)),
                Cell::from(p(win, |p| p.p99_us)),
                Cell::from(all.count.to_string()),
                Cell::from(p(Some(all), |p| p.p99_us)),
            ])
        })
        .collect();
    let widths = [15, 6, 8, 8, 8, 9, 8].map(Constraint::Length);
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(vec!["tool", "calls", "p50", "p95", "p99", "all calls", "all p99"]).style(t.dim()))
            .block(
                Block::default()
                    .borders(Borders::TOP)
                    .title(Span::styled(" dispatch latency, window (all time at the right) ", t.accent())),
            ),
        area,
    );
}

/// Draws the metrics pane.
pub fn render(app: &App, frame: &mut Frame, area: Rect, t: Theme) {
    let block = Block::default()
        .borders(Borders::TOP)
        .title(Span::styled(" Metrics (last 15 minutes, from the database) ", t.accent()));
    let Rows::Metrics(m) = &app.rows else {
        frame.render_widget(Paragraph::new("  loading…").block(block), area);
        return;
    };
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let dup_style = if m.side_effect_duplicates == 0 { t.ok() } else { t.bad() };
    let oldest = m.oldest_unknown_age_ms.map_or_else(|| "none".to_string(), human_ms);
    let summary = Line::from(vec![
        Span::styled(" duplicate effects ", t.dim()),
        Span::styled(
            format!(" {} ", m.side_effect_duplicates),
            dup_style.add_modifier(ratatui::style::Modifier::REVERSED),
        ),
        Span::styled("   outcome unknown ", t.dim()),
        Span::styled(m.outcome_unknown.to_string(), if m.outcome_unknown == 0 { t.ok() } else { t.bad() }),
        Span::styled("   oldest unknown ", t.dim()),
        Span::raw(oldest),
    ]);
    let rates = m.rates.len() as u16;
    let [top, rates_area, lat_area] =
        Layout::vertical([Constraint::Length(2), Constraint::Length(rates.min(10)), Constraint::Min(3)]).areas(inner);
    frame.render_widget(Paragraph::new(summary), top);
    let label_w = 24u16;
    // The sparklines take one column per bucket; the resilience section takes the rest.
    let buckets = m.rates.iter().map(|r| r.counts.len()).max().unwrap_or(0);
    let spark_w = (label_w + 1 + u16::try_from(buckets).unwrap_or(60).min(60) + 2).min(rates_area.width);
    let [spark_area, res_area] =
        Layout::horizontal([Constraint::Length(spark_w), Constraint::Min(0)]).areas(rates_area);
    if res_area.width >= 30 {
        render_resilience(app, &m.resilience, frame, res_area, t);
    }
    for (i, r) in m.rates.iter().take(spark_area.height as usize).enumerate() {
        let y = spark_area.y + i as u16;
        let label = Rect { x: spark_area.x, y, width: label_w.min(spark_area.width), height: 1 };
        frame.render_widget(
            Paragraph::new(Line::from(vec![
                Span::styled(format!(" {:<13}", r.name), t.dim()),
                Span::raw(format!("{:>8}", r.total)),
            ])),
            label,
        );
        if spark_area.width > label_w + 2 {
            let sp = Rect { x: spark_area.x + label_w + 1, y, width: spark_area.width - label_w - 1, height: 1 };
            let data: Vec<u64> = r.counts.iter().map(|c| u64::try_from(*c).unwrap_or(0)).collect();
            frame.render_widget(Sparkline::default().data(&data).style(t.accent()), sp);
        }
    }
    let widths = [
        Constraint::Length(18),
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(10),
    ];
    // Two tables side by side need 2 × 60 columns; narrower, one table holds the
    // window and the all-time count and p99, so tool names are not cut.
    if lat_area.width < 120 {
        render_latency_narrow(m, frame, lat_area, t);
        return;
    }
    let [win, all] = Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(lat_area);
    let header = || Row::new(vec!["tool", "calls", "p50", "p95", "p99"]).style(t.dim());
    frame.render_widget(
        Table::new(latency_rows(&m.latency_window), widths).header(header()).block(
            Block::default().borders(Borders::TOP).title(Span::styled(" dispatch latency, window ", t.accent())),
        ),
        win,
    );
    frame.render_widget(
        Table::new(latency_rows(&m.latency_all_time), widths)
            .header(header())
            .block(Block::default().borders(Borders::TOP).title(Span::styled(" all time ", t.accent()))),
        all,
    );
}
