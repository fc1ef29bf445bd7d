//! The committed `demo.db` matches its generator, holds every state, and opening
//! the demo never touches the committed file.

use std::fmt::Write as _;
use std::path::Path;

use crate::support::raw;

/// Every table's rows as text, sorted; wall-clock step durations and latency
/// rollups left out (they are measured, not generated).
fn logical_dump(path: &Path) -> Vec<String> {
    let c = raw(path);
    let tables: Vec<String> = c
        .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut out = Vec::new();
    for t in tables {
        // Latency rollups bucket measured wall-clock durations.
        if t.contains("latency") {
            continue;
        }
        let mut st = c.prepare(&format!("SELECT * FROM {t}")).unwrap();
        let names: Vec<String> = st.column_names().iter().map(|s| (*s).to_string()).collect();
        let mut rows: Vec<String> = st
            .query_map([], |r| {
                let mut s = format!("{t}:");
                for (i, n) in names.iter().enumerate() {
                    if n.ends_with("_us") {
                        continue;
                    }
                    let v: rusqlite::types::Value = r.get(i)?;
                    let _ = write!(s, "{n}={v:?};");
                }
                Ok(s)
            })
            .unwrap()
            .map(Result::unwrap)
            .collect();
        rows.sort();
        out.extend(rows);
    }
    out
}

#[test]
fn the_committed_demo_db_matches_the_generator() {
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("fresh.db");
    toolgate::demo::generate(&fresh, toolgate::demo::DEMO_SEED).unwrap();
    let committed = dir.path().join("committed.db");
    std::fs::write(&committed, toolgate::demo::DEMO_DB).unwrap();
    let (a, b) = (logical_dump(&committed), logical_dump(&fresh));
    let diff: Vec<_> = a.iter().zip(&b).filter(|(x, y)| x != y).take(3).collect();
    assert!(
        a == b,
        "demo.db is stale: run `cargo run -- demo-db --out /tmp/demo.db && mv /tmp/demo.db demo.db` and commit.\nfirst differences: {diff:#?}\nrows {} vs {}",
        a.len(),
        b.len()
    );
}

#[test]
fn the_demo_holds_every_state_and_the_working_copy_is_rebased() {
    let dir = tempfile::tempdir().unwrap();
    let now = 1_900_000_000_000;
    let path = toolgate::demo::working_copy(dir.path(), now).unwrap();
    let c = raw(&path);
    let states: Vec<String> = c
        .prepare("SELECT DISTINCT state FROM operations ORDER BY 1")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for s in ["accepted", "failed", "needs_review", "resolved", "succeeded", "unknown"] {
        assert!(states.iter().any(|x| x == s), "missing {s}: {states:?}");
    }
    let pending: i64 = c
        .query_row("SELECT count(*) FROM approvals WHERE state = 'pending' AND expires_at > ?1", [now], |r| r.get(0))
        .unwrap();
    assert!(pending >= 2, "live pending approvals after re-basing");
    let latest: i64 = c.query_row("SELECT max(updated_at) FROM operations", [], |r| r.get(0)).unwrap();
    assert!(latest <= now && now - latest < 3_600_000, "re-based to now");
    // Unknowns cover: receipt available, not yet available, mismatching.
    let replays: i64 =
        c.query_row("SELECT count(*) FROM trace_events WHERE delivery = 'local_replay'", [], |r| r.get(0)).unwrap();
    let conflicts: i64 =
        c.query_row("SELECT count(*) FROM trace_events WHERE code = 'IDEMPOTENCY_CONFLICT'", [], |r| r.get(0)).unwrap();
    assert!(replays >= 1 && conflicts >= 1);
    let dups: i64 = c
        .query_row(
            "SELECT count(*) FROM (SELECT intent FROM provider_effects GROUP BY intent HAVING count(*) > 1)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(dups, 0);
}

/// Issue 32 §2: the working copy's operator log stayed at the demo's own
/// times while everything else moved to now. It moves too, its chain re-linked
/// over the new times and every anchor with it: the copy audits clean, its
/// newest entry is at most minutes old, and the log is append-only again.
fn the_working_copy_moves_its_operator_log_and_audits_clean(backend: crate::support::Backend) {
    let dir = tempfile::tempdir().unwrap();
    let pg = (backend == crate::support::Backend::Postgres).then(|| crate::support::PgDb::new().unwrap());
    let now = chrono::Utc::now().timestamp_millis();
    let db = match &pg {
        None => toolgate::demo::working_copy(dir.path(), now).unwrap(),
        Some(p) => toolgate::demo::working_copy_at(Path::new(&p.url), now).unwrap(),
    };
    let clock = toolgate::engine::clock::ManualClock::new(now);
    let mut e = toolgate::engine::Engine::open(&db, crate::support::opts(&clock, "copy")).unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    assert!(e.audit_warnings().unwrap().is_empty(), "{:?}", e.audit_warnings().unwrap());
    let log = e.audit_log(1_000).unwrap();
    assert!(!log.is_empty());
    let newest = log.iter().map(|r| r.at).max().unwrap();
    assert!(newest <= now && now - newest < 3_600_000, "the log is at the demo's own time: {newest} vs {now}");
    let refused = match &pg {
        None => raw(&db).execute("UPDATE audit_log SET reason = 'x'", []).is_err(),
        Some(p) => p.client().execute("UPDATE audit_log SET reason = 'x'", &[]).is_err(),
    };
    assert!(refused, "the operator log is append-only again");
}

crate::on_both_backends!(the_working_copy_moves_its_operator_log_and_audits_clean);
