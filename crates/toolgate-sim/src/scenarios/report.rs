//! The learner's table: one row per step (step, clock, action, transition,
//! retryable, what the user sees, effects, PASS/FAIL), as `toolgate scenario run`
//! prints it.

use std::fmt::Write as _;

use super::runner::{fmt_offset, CrashKind, ScenarioReport, StepObservation};
use super::Script;

/// The last line of a run: `N passed, M failed` (scenarios).
pub fn summary_line(passed: usize, failed: usize) -> String {
    format!("{passed} passed, {failed} failed")
}

fn retryable(o: &StepObservation) -> String {
    match (o.retryable, o.retry_after_ms) {
        (None, _) => "-".into(),
        (Some(false), _) => "no".into(),
        (Some(true), Some(ms)) if ms > 0 => format!("yes, in {}", fmt_offset(ms as i64).trim_start_matches('+')),
        (Some(true), _) => "yes".into(),
    }
}

fn effects(o: &StepObservation) -> String {
    let mut s = o.effects.to_string();
    if o.new_effects != 0 {
        let _ = write!(s, " (+{})", o.new_effects);
    }
    if o.duplicates != 0 {
        let _ = write!(s, " DUPLICATES {}", o.duplicates);
    }
    s
}

fn wrap(text: &str, width: usize, indent: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            let _ = writeln!(out, "{indent}{line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(out, "{indent}{line}");
    }
    out
}

/// One scenario's table, with a line under a row for a crash's mode and for
/// every field that did not match.
pub fn render(r: &ScenarioReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Scenario {}: {}", r.id, r.title);
    out.push_str(&wrap(&r.summary, 96, "  "));
    out.push('\n');
    let head = ["step", "at", "action", "transition", "retryable", "user sees", "effects", "result"];
    let rows: Vec<[String; 8]> = r
        .steps
        .iter()
        .map(|o| {
            [
                o.step.to_string(),
                fmt_offset(o.at_ms),
                o.label.clone(),
                o.transition.to_string(),
                retryable(o),
                o.sees.clone(),
                effects(o),
                if o.passed { "PASS".into() } else { "FAIL".into() },
            ]
        })
        .collect();
    let mut width = head.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String; 8]| {
        let mut s = String::from(" ");
        for (i, (cell, w)) in cells.iter().zip(width).enumerate() {
            // The step number is right-aligned; the last column is not padded.
            if i == 0 {
                let _ = write!(s, " {cell:>w$}");
            } else if i == cells.len() - 1 {
                let _ = write!(s, "  {cell}");
            } else {
                let _ = write!(s, "  {cell:<w$}");
            }
        }
        s.trim_end().to_string()
    };
    let _ = writeln!(out, "{}", line(&head.map(str::to_string)));
    let pad = " ".repeat(3 + width[0] + 2);
    for (row, o) in rows.iter().zip(&r.steps) {
        let _ = writeln!(out, "{}", line(row));
        if let Some(c) = &o.crash {
            let mode = match c.mode {
                CrashKind::ChildProcess => "real crash",
                CrashKind::InProcess => "simulated crash",
            };
            let _ = writeln!(out, "{pad}↳ {mode}: {}", c.detail);
        }
        for m in &o.failures {
            let _ = writeln!(out, "{pad}✗ {}: expected {}, got {}", m.field, m.expected, m.actual);
        }
    }
    let ran = r.steps.len();
    let passed = r.steps.iter().filter(|o| o.passed).count();
    let verdict = if r.passed { "PASS" } else { "FAIL" };
    let mut tail = format!("  {verdict}: {passed} of {} steps passed", r.total_steps);
    if ran < r.total_steps {
        let _ = write!(tail, " (stopped after step {ran})");
    }
    let _ = writeln!(out, "{tail}");
    if let Some(p) = &r.kept_db {
        let _ = writeln!(out, "  database kept at {}", p.display());
    }
    out
}

/// The `toolgate scenario list` table.
pub fn list(scripts: &[Script]) -> String {
    let w = scripts.iter().map(|s| s.slug.chars().count()).max().unwrap_or(4).max(4);
    let mut out = format!("{:>3}  {:<w$}  {:>5}  title\n", "id", "slug", "steps");
    for s in scripts {
        let _ = writeln!(out, "{:>3}  {:<w$}  {:>5}  {}", s.id, s.slug, s.steps.len(), s.title);
    }
    out
}
