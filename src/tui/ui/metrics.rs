//! The metrics pane: rates over the last 15 minutes with sparklines, dispatch
//! latency p50/p95/p99 per tool, the oldest unknown operation's age and the
//! duplicate-effects counter. Everything comes from `telemetry::metrics::snapshot`,
//! computed from the database, so every process sees the same numbers.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table};
use ratatui::Frame;

use super::Theme;
use crate::telemetry::metrics::ToolLatency;
use crate::tui::app::{App, Rows};
use crate::tui::format::human_ms;

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
    let [top, spark_area, lat_area] =
        Layout::vertical([Constraint::Length(2), Constraint::Length(rates.min(10)), Constraint::Min(3)]).areas(inner);
    frame.render_widget(Paragraph::new(summary), top);
    let label_w = 24u16;
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
            let sp =
                Rect { x: spark_area.x + label_w + 1, y, width: (spark_area.width - label_w - 1).min(60), height: 1 };
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
