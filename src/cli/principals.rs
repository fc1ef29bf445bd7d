//! `toolgate tenant`, `toolgate subject` and `toolgate token`: who may call.

use super::{
    open, open_read, operator_or_user, print_json, Cli, CliError, SubjectCommand, TenantCommand, TokenCommand,
};
use crate::engine::clock::{parse_rfc3339, rfc3339};
use serde_json::{json, Value};

pub(super) fn tenant_command(cli: &Cli, what: &TenantCommand) -> Result<i32, CliError> {
    let operator = operator_or_user(cli);
    let mut engine = open(cli)?;
    match what {
        TenantCommand::Add { name, approvers, approval_threshold_minor, json } => {
            let spec = crate::engine::world::TenantSpec {
                id: name.clone(),
                approvers: approvers.clone(),
                approval_threshold_minor: *approval_threshold_minor,
            };
            engine.add_tenant(&spec, &operator)?;
            if *json {
                print_json(&json!({"action": "tenant_add", "tenant": name, "changed": true}));
            } else {
                outln!("tenant {} added", crate::display::escape(name));
            }
        }
        TenantCommand::Disable(a) | TenantCommand::Enable(a) => {
            let enable = matches!(what, TenantCommand::Enable(_));
            let changed = engine.set_enabled(&a.name, None, enable, &operator)?;
            principal_changed(a.json, "tenant", enable, changed);
        }
    }
    Ok(0)
}

pub(super) fn subject_command(cli: &Cli, what: &SubjectCommand) -> Result<i32, CliError> {
    let operator = operator_or_user(cli);
    let mut engine = open(cli)?;
    match what {
        SubjectCommand::Add(a) => {
            engine.add_subject(&a.tenant, &a.name, &operator)?;
            if a.json {
                print_json(&json!({"action": "subject_add", "tenant": a.tenant, "subject": a.name, "changed": true}));
            } else {
                outln!("subject {} added to {}", crate::display::escape(&a.name), crate::display::escape(&a.tenant));
            }
        }
        SubjectCommand::Disable(a) | SubjectCommand::Enable(a) => {
            let enable = matches!(what, SubjectCommand::Enable(_));
            let changed = engine.set_enabled(&a.tenant, Some(&a.name), enable, &operator)?;
            principal_changed(a.json, "subject", enable, changed);
        }
    }
    Ok(0)
}

pub(super) fn principal_changed(json: bool, who: &str, enable: bool, changed: bool) {
    let verb = if enable { "enable" } else { "disable" };
    if json {
        print_json(&json!({"action": format!("{who}_{verb}"), "changed": changed}));
    } else {
        outln!("{verb}d{}", if changed { "" } else { " (it already was)" });
    }
}

pub(super) fn token_command(cli: &Cli, what: &TokenCommand) -> Result<i32, CliError> {
    use crate::engine::tokens::TokenFor;
    match what {
        TokenCommand::Create { tenant, subject, all_tenants, name, expires, json } => {
            let who = match (tenant.as_slice(), subject, &cli.operator, all_tenants) {
                ([t], Some(s), None, false) => TokenFor::Subject { tenant: t.clone(), subject: s.clone() },
                ([], None, Some(o), true) => TokenFor::Operator { operator: o.clone(), tenants: None },
                ([_, ..], None, Some(o), false) => TokenFor::Operator { operator: o.clone(), tenants: Some(tenant.clone()) },
                ([], None, Some(_), false) => {
                    return Err(CliError::new(
                        "USAGE",
                        "an operator token names the tenants it may act in (--tenant T, repeatable) or says --all-tenants",
                    ))
                }
                _ => {
                    return Err(CliError::new(
                        "USAGE",
                        "give either --tenant T --subject S (an agent's token) or --operator NAME with --tenant T... or --all-tenants (an operator's), not both",
                    ))
                }
            };
            let expires_at = expires
                .as_deref()
                .map(|s| {
                    parse_rfc3339(s).ok_or_else(|| {
                        CliError::new("BAD_TIME", "--expires must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z")
                    })
                })
                .transpose()?;
            let mut engine = open(cli)?;
            let t = engine.create_token(&who, name.as_deref(), expires_at)?;
            if *json {
                print_json(&json!({"token": t.token, "id": t.row.id, "prefix": t.row.prefix, "kind": t.row.kind,
                    "tenant": t.row.tenant, "subject": t.row.subject, "operator": t.row.operator, "name": t.row.name,
                    "expires_at": t.row.expires_at.map(rfc3339)}));
            } else {
                outln!("{}", t.token);
                eprintln!("token {} ({}): shown once, the ledger keeps only its digest", t.row.id, t.row.kind);
            }
            Ok(0)
        }
        TokenCommand::List { json } => {
            let mut engine = open_read(cli)?;
            let rows = engine.tokens()?;
            let now = engine.clock().now_ms();
            let state = |r: &crate::store::TokenRow| {
                if r.revoked_at.is_some() {
                    "revoked"
                } else if r.expires_at.is_some_and(|t| now >= t) {
                    "expired"
                } else {
                    "active"
                }
            };
            if *json {
                let list: Vec<Value> = rows
                    .iter()
                    .map(|r| {
                        json!({"id": r.id, "prefix": r.prefix, "kind": r.kind, "tenant": r.tenant, "subject": r.subject,
                        "operator": r.operator, "name": r.name, "created_at": rfc3339(r.created_at),
                        "expires_at": r.expires_at.map(rfc3339), "revoked_at": r.revoked_at.map(rfc3339),
                        "state": state(r),
                        "operator_tenants": (r.kind == "operator").then(|| match &r.operator_tenants {
                            None => json!("all"),
                            Some(t) => json!(t.split(',').collect::<Vec<_>>()),
                        })})
                    })
                    .collect();
                print_json(&json!({"tokens": list}));
            } else if rows.is_empty() {
                outln!("no tokens");
            } else {
                outln!("{:<20} {:<20} {:<8} {:<28} {:<8} name", "id", "prefix", "kind", "for", "state");
                for r in &rows {
                    let who = match (&r.tenant, &r.subject, &r.operator) {
                        (Some(t), Some(s), _) => format!("{t}/{s}"),
                        (_, _, Some(o)) => match &r.operator_tenants {
                            None => format!("{o} (all tenants)"),
                            Some(t) => format!("{o} ({t})"),
                        },
                        _ => "?".into(),
                    };
                    outln!(
                        "{:<20} {:<20} {:<8} {:<28} {:<8} {}",
                        r.id,
                        r.prefix,
                        r.kind,
                        crate::display::escape(&who),
                        state(r),
                        crate::display::escape(r.name.as_deref().unwrap_or("-"))
                    );
                }
            }
            Ok(0)
        }
        TokenCommand::Revoke { id, json } => {
            let mut engine = open(cli)?;
            let changed = engine.revoke_token(id)?;
            if *json {
                print_json(&json!({"revoked": id, "changed": changed}));
            } else {
                outln!("revoked{}", if changed { "" } else { " (it already was)" });
            }
            Ok(0)
        }
    }
}
