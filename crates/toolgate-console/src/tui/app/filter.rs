//! Filter expressions (model state): `tenant:acme state:outcome_unknown
//! tool:create_refund age:>5m needs:review`, bare words matching ids (and
//! exact tenants, subjects, states, tools) as before. A term that is not
//! understood is named in the error, with what would have been. The parse
//! gives a [`Filter`] the store applies; each pane says which fields it has.

use super::Pane;
use crate::store::{Filter, FilterTarget, OpState};
use crate::tui::format::short;

/// The fields a term may name, as the error for an unknown one lists them.
pub const FIELDS: &[&str] = &["tenant", "subject", "tool", "state", "id", "age", "needs", "actor", "action"];

/// Longest filter kept.
pub const MAX_FILTER: usize = 200;

/// What a pane's rows can be filtered as; `None` for panes without a table.
pub fn target(pane: Pane) -> Option<FilterTarget> {
    match pane {
        Pane::Ledger | Pane::Unknown => Some(FilterTarget::Operations),
        Pane::Live => Some(FilterTarget::Live),
        Pane::Approvals => Some(FilterTarget::Approvals),
        Pane::Audit => Some(FilterTarget::Audit),
        Pane::Walkthrough | Pane::Metrics => None,
    }
}

/// A duration for people: `30s`, `5m`, `2h`, `1d`, `1h30m`, `250ms`, in
/// milliseconds. Used by `age:` and the CLI's `--older-than`.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let bad = || format!("{:?} is not a duration (like 30s, 5m, 2h, 1d or 1h30m)", short(text, 20));
    let s = text.trim();
    if s.is_empty() {
        return Err(bad());
    }
    let mut total: i64 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad());
        }
        let n: i64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = n.checked_mul(scale).and_then(|v| total.checked_add(v)).ok_or_else(bad)?;
    }
    Ok(total)
}

/// A state as the ledger names it (`outcome_unknown` is `unknown`), or what is wrong.
pub fn state_name(s: &str) -> Result<String, String> {
    let s = if s == "outcome_unknown" { "unknown" } else { s };
    OpState::parse(s).map(|state| state.as_str().to_string()).ok_or_else(|| {
        let all: Vec<&str> = OpState::ALL.iter().map(|s| s.as_str()).collect();
        format!("state:{} is not a state (one of {}, or outcome_unknown)", short(s, 20), all.join(", "))
    })
}

fn once(slot: &mut Option<String>, field: &str, value: &str) -> Result<(), String> {
    if slot.replace(value.to_string()).is_some() {
        return Err(format!("{field}: is given twice"));
    }
    Ok(())
}

/// Parses a filter expression; the error names the term it did not understand.
pub fn parse(text: &str) -> Result<Filter, String> {
    let mut f = Filter::default();
    let mut age_set = false;
    let mut state_set = false;
    // needs:review adds needs_review to the states, after the parse: the states
    // are alternatives, so `state:outcome_unknown needs:review` is the whole
    // triage queue (unknown or needing review), in either order.
    let mut needs_review = false;
    for term in text.split_whitespace() {
        let Some((field, value)) = term.split_once(':') else {
            f.words.push(term.to_string());
            continue;
        };
        let field = field.to_ascii_lowercase();
        if value.is_empty() {
            return Err(format!("{}: needs a value ({field}:VALUE)", short(&field, 20)));
        }
        match field.as_str() {
            "tenant" => once(&mut f.tenant, "tenant", value)?,
            "subject" | "requester" => once(&mut f.subject, "subject", value)?,
            "tool" => once(&mut f.tool, "tool", value)?,
            "id" => once(&mut f.id_prefix, "id", value)?,
            "actor" => once(&mut f.actor, "actor", value)?,
            "action" => once(&mut f.action, "action", value)?,
            "state" => {
                if std::mem::replace(&mut state_set, true) {
                    return Err("state: is given twice (list several as state:unknown,needs_review)".into());
                }
                for s in value.split(',').filter(|s| !s.is_empty()) {
                    let s = state_name(&s.to_ascii_lowercase())?;
                    if !f.states.contains(&s) {
                        f.states.push(s);
                    }
                }
            }
            "age" => {
                if std::mem::replace(&mut age_set, true) {
                    return Err("age: is given twice".into());
                }
                let (older, d) = match value.as_bytes()[0] {
                    b'>' => (true, &value[1..]),
                    b'<' => (false, &value[1..]),
                    _ => (true, value),
                };
                let ms = parse_duration(d).map_err(|e| format!("age:{}: {e}", short(value, 20)))?;
                if older {
                    f.older_than_ms = Some(ms);
                } else {
                    f.newer_than_ms = Some(ms);
                }
            }
            "needs" => match value.to_ascii_lowercase().as_str() {
                "review" => needs_review = true,
                "query" => f.never_queried = true,
                other => {
                    return Err(format!(
                        "needs:{} is not understood (needs:review, or needs:query for no status query yet)",
                        short(other, 20)
                    ))
                }
            },
            _ => return Err(format!("{}: no such field ({})", short(term, 30), FIELDS.join(" "))),
        }
    }
    if needs_review && !f.states.iter().any(|s| s == "needs_review") {
        f.states.push("needs_review".into());
    }
    Ok(f)
}

/// Parses `text` for `pane`: also refuses a field the pane has no column for.
pub fn parse_for(text: &str, pane: Pane) -> Result<Filter, String> {
    let f = parse(text)?;
    if let Some(field) = target(pane).and_then(|t| f.unsupported(t)) {
        return Err(format!("the {} pane cannot be filtered by {field}", pane.title()));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expect: &Result<Filter, &str>) {
        let got = parse(text);
        match (&got, expect) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{text}"),
            (Err(a), Err(b)) => assert!(a.contains(b), "{text}: {a:?} should contain {b:?}"),
            _ => panic!("{text}: got {got:?}, expected {expect:?}"),
        }
    }

    #[test]
    fn expressions_parse_into_filters_or_say_what_was_not_understood() {
        check("", &Ok(Filter::default()));
        check("op_64", &Ok(Filter::word("op_64")));
        check(
            "tenant:acme state:outcome_unknown tool:create_refund age:>5m needs:query",
            &Ok(Filter {
                tenant: Some("acme".into()),
                states: vec!["unknown".into()],
                tool: Some("create_refund".into()),
                older_than_ms: Some(300_000),
                never_queried: true,
                ..Filter::default()
            }),
        );
        check(
            "needs:review age:<1h30m acme",
            &Ok(Filter {
                words: vec!["acme".into()],
                states: vec!["needs_review".into()],
                newer_than_ms: Some(5_400_000),
                ..Filter::default()
            }),
        );
        check(
            "state:unknown,needs_review,unknown id:op_6",
            &Ok(Filter {
                states: vec!["unknown".into(), "needs_review".into()],
                id_prefix: Some("op_6".into()),
                ..Filter::default()
            }),
        );
        check("age:2d", &Ok(Filter { older_than_ms: Some(172_800_000), ..Filter::default() }));
        check("colour:red", &Err("colour:red: no such field (tenant subject tool state id age needs actor action)"));
        check("state:stuck", &Err("state:stuck is not a state"));
        check("age:>5x", &Err("age:>5x: \"5x\" is not a duration"));
        check("age:>", &Err("is not a duration"));
        check("tenant:", &Err("tenant: needs a value"));
        check("tenant:a tenant:b", &Err("tenant: is given twice"));
        check("needs:coffee", &Err("needs:coffee is not understood"));
        // The issue's own example: unknown or needing review, whatever the order.
        let triage = Filter {
            tenant: Some("acme".into()),
            states: vec!["unknown".into(), "needs_review".into()],
            tool: Some("create_refund".into()),
            older_than_ms: Some(300_000),
            ..Filter::default()
        };
        check("tenant:acme state:outcome_unknown tool:create_refund age:>5m needs:review", &Ok(triage.clone()));
        check("needs:review tenant:acme tool:create_refund age:>5m state:outcome_unknown", &Ok(triage));
        check(
            "state:needs_review needs:review",
            &Ok(Filter { states: vec!["needs_review".into()], ..Filter::default() }),
        );
        check("state:unknown needs:review state:failed", &Err("state: is given twice"));
        check("age:99999999999999999d", &Err("is not a duration"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(250));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("-5m").is_err());
    }

    #[test]
    fn a_pane_refuses_a_field_it_has_no_column_for() {
        assert!(parse_for("state:unknown", Pane::Unknown).is_ok());
        let e = parse_for("state:unknown", Pane::Approvals).unwrap_err();
        assert!(e.contains("the Approvals pane cannot be filtered by state"), "{e}");
        assert!(parse_for("actor:alice", Pane::Audit).is_ok());
        assert!(parse_for("actor:alice", Pane::Ledger).is_err());
    }
}
