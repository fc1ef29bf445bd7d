//! `--all` on query, approve, deny and resolve: the selection, the plan and
//! the one call per row.

use super::{open, open_read, print_json, Cli, CliError, ResolveArgs, ResolveAs, SelectArgs};
use crate::engine::{BulkAction, BulkTarget, Engine, Resolution};
use serde_json::{json, Value};

/// A bulk selection as a store filter; a bad state or duration is a usage error.
pub(super) fn select_filter(
    sel: &SelectArgs,
    tenant: Option<&str>,
    approvals: bool,
) -> Result<crate::store::Filter, CliError> {
    use crate::tui::app::filter::{parse_duration, state_name};
    let bad = |m: String| CliError::new("BAD_SELECTION", m);
    let mut f = crate::store::Filter {
        tenant: tenant.map(str::to_string),
        tool: sel.select_tool.clone(),
        older_than_ms: sel.older_than.as_deref().map(parse_duration).transpose().map_err(bad)?,
        ..crate::store::Filter::default()
    };
    if approvals {
        if !sel.state.is_empty() {
            return Err(bad("--state selects operations; approvals are all pending".into()));
        }
    } else {
        let states =
            if sel.state.is_empty() { vec!["unknown".to_string(), "needs_review".into()] } else { sel.state.clone() };
        f.states =
            states.iter().map(|s| state_name(&s.trim().to_ascii_lowercase())).collect::<Result<_, _>>().map_err(bad)?;
    }
    Ok(f)
}

/// The rows a filter matches, every one (keyset pages of 500), as targets
/// with what a listing shows: (target, state, tool, tenant).
pub(super) fn select_rows(
    engine: &mut Engine,
    f: &crate::store::Filter,
    approvals: bool,
) -> Result<Vec<(BulkTarget, String, String, String)>, CliError> {
    use crate::store::{cursor_after, Key, OpsView, Order, APPROVALS_SORT, OPS_SORT};
    // Id order: stable, and every row once however the set changes meanwhile.
    let order = Order { column: 1, desc: false };
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let n = if approvals {
            let page = engine.approvals_page(f, order, cursor.as_ref(), 500)?;
            cursor = page.last().map(|a| cursor_after(APPROVALS_SORT, order, a, Key::Text(a.id.clone())));
            out.extend(page.iter().map(|a| {
                (
                    BulkTarget { id: a.id.clone(), seen_version: None },
                    a.state.to_string(),
                    a.tool.clone(),
                    a.tenant.clone(),
                )
            }));
            page.len()
        } else {
            let page = engine.ops_page(OpsView::All, f, order, cursor.as_ref(), 500)?;
            cursor = page.last().map(|o| cursor_after(OPS_SORT, order, o, Key::Text(o.id.clone())));
            out.extend(page.iter().map(|o| {
                (
                    BulkTarget { id: o.id.clone(), seen_version: Some(o.version) },
                    o.state.to_string(),
                    o.tool.clone(),
                    o.tenant.clone(),
                )
            }));
            page.len()
        };
        if n < 500 {
            return Ok(out);
        }
    }
}

/// `query|approve|deny|resolve --all`: the selection, then (unless
/// `--dry-run`) the action on each. Exit 0 when every row ended as meant,
/// 1 when any was refused or is still unknown, 2 for a usage error.
pub(super) fn bulk_command(
    cli: &Cli,
    sel: &SelectArgs,
    tenant: Option<&str>,
    action: &BulkAction,
    operator: &str,
    json: bool,
) -> Result<i32, CliError> {
    action.check()?;
    let filter = select_filter(sel, tenant, action.on_approvals())?;
    if !sel.dry_run && operator.is_empty() {
        return Err(CliError::new(
            "OPERATOR_REQUIRED",
            format!("--operator NAME is required to {} --all (not for --dry-run)", action.verb()),
        ));
    }
    let mut engine = if sel.dry_run { open_read(cli)? } else { open(cli)? };
    let rows = select_rows(&mut engine, &filter, action.on_approvals())?;
    let verb = action.verb();
    if sel.dry_run {
        if json {
            let list: Vec<Value> = rows
                .iter()
                .map(|(t, state, tool, tenant)| json!({"id": t.id, "state": state, "tool": tool, "tenant": tenant}))
                .collect();
            print_json(&json!({"action": verb, "dry_run": true, "selected": rows.len(), "would_touch": list}));
        } else {
            for (t, state, tool, tenant) in &rows {
                outln!(
                    "would {verb} {}  {state}  {}  {}",
                    t.id,
                    crate::display::escape(tool),
                    crate::display::escape(tenant)
                );
            }
            outln!("{} would be touched (dry run: nothing changed)", rows.len());
        }
        return Ok(0);
    }
    let targets: Vec<BulkTarget> = rows.into_iter().map(|(t, ..)| t).collect();
    let report = engine.bulk(action, &targets, operator, |_, _| {})?;
    if json {
        print_json(&json!({
            "action": verb, "dry_run": false, "selected": targets.len(), "results": report.items,
            "summary": report.summary(), "all_done": report.all_done(),
        }));
    } else {
        for it in &report.items {
            outln!("{verb} {}: {} ({})", it.id, it.outcome, crate::display::escape(&it.message));
        }
        outln!("{verb} {}: {}", targets.len(), report.summary());
    }
    Ok(i32::from(!report.all_done()))
}

pub(super) fn print_outcome(o: &crate::engine::OperatorOutcome, json: bool) {
    if json {
        print_json(o);
    } else if o.applied {
        outln!("ok: {}", o.message);
    } else {
        outln!("refused [{}]: {}", o.code, o.message);
    }
}

/// `resolve --all`: the resolution of every operation the selection matches.
pub(super) fn bulk_resolve(cli: &Cli, a: &ResolveArgs) -> Result<i32, CliError> {
    let operator = cli.operator.clone().unwrap_or_default();
    let resolution = match a.resolution {
        ResolveAs::Succeeded => Resolution::Succeeded,
        ResolveAs::Failed => Resolution::Failed,
        ResolveAs::Compensated => Resolution::Compensated,
    };
    let action = BulkAction::Resolve { resolution, note: a.act.note.clone(), no_evidence: a.no_evidence };
    bulk_command(cli, &a.select, a.tenant.as_deref(), &action, &operator, a.act.json)
}
