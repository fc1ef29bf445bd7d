//! The safety invariants, as one checker shared by the crash loop, the failpoint
//! tests, the multi-process race and the ledger state machine.
//!
//! The checker reads the database at rest (no process is running on it) with a
//! raw connection plus the engine's own `audit()` and `counts()`, and returns every
//! violation it finds as a line of text, so that a test can assert the list is
//! empty and a control run can assert that it is not.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use toolgate::engine::canonical::sha256_hex;
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::Engine;

use crate::support::RawDb;

/// The states an operation may rest in once recovery has run (docs/design.md §6): nothing
/// is left `accepted` or `in_flight`.
pub const SETTLED: [&str; 5] = ["succeeded", "failed", "unknown", "needs_review", "resolved"];

/// How strict to be.
#[derive(Debug, Clone, Copy, Default)]
pub struct Expect {
    /// Recovery has run: every operation must be in a [`SETTLED`] state and no
    /// outbox row may be pending or leased.
    pub settled: bool,
    /// Explicit status queries have run with a clock past every receipt delay:
    /// an operation still `unknown` must have no effect downstream (the query
    /// would have found it).
    pub queried: bool,
}

/// What the ledger holds, for reports.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Operations per state.
    pub states: BTreeMap<String, i64>,
    /// Provider effects.
    pub effects: i64,
    /// Intents with more than one effect.
    pub duplicates: i64,
}

/// The business intent label the engine sends downstream for a scope.
pub fn intent(tenant: &str, subject: &str, tool: &str, key: &str) -> String {
    sha256_hex(format!("{tenant}\0{subject}\0{tool}\0{key}").as_bytes())
}

struct Op {
    id: String,
    tenant: String,
    subject: String,
    tool: String,
    key: String,
    state: String,
    request_sha256: String,
    request_json: String,
    downstream_key: String,
    receipt_id: Option<String>,
    result_sha256: Option<String>,
    result_json: Option<String>,
    downstream_request_id: Option<String>,
    resolution: Option<String>,
    call: (String, String, String, String),
    approval_id: Option<String>,
}

struct Effect {
    downstream_key: String,
    intent: String,
    body_sha256: String,
    receipt_id: String,
}

/// Checks every invariant; returns the violations (empty when the ledger is sound).
///
/// Invariants, each a line of the returned list when broken:
/// 1. **No second effect**: no business intent has more than one provider effect
///    (`counts().side_effect_duplicates == 0`, and checked per intent).
/// 2. **Every effect belongs to an accepted operation**: its intent is the scope of
///    exactly one operation and it was sent under that operation's downstream key.
/// 3. **Nothing half-written**: every operation has its outbox row and the call
///    binding of the call that created it; the outbox state agrees with the
///    operation state; the attempt counter equals the attempt rows; an attempt is
///    open only under a live lease; every approved approval names an operation
///    that exists and names it back.
/// 4. **Every `succeeded` has its evidence**: result, result digest, receipt id and
///    downstream request id, a `receipts` row for this operation with the same
///    body and result digests, and a provider effect under the operation's key
///    whose receipt and body digest match.
/// 5. **`failed` means no effect**: a definitive failure has no provider effect.
/// 6. **Business state follows the ledger**: each order's refunded amount is its
///    initial amount plus the refunds that succeeded (or were resolved as
///    succeeded), each counted once.
/// 7. **The engine's own audit** (digests, bindings, status_refs, lease shapes,
///    SQLite integrity and foreign keys) reports no finding.
/// 8. With [`Expect::settled`], every operation is in exactly one of the
///    [`SETTLED`] states and no outbox row is pending or leased; with
///    [`Expect::queried`], an operation still `unknown` has no effect downstream.
pub fn check(path: &Path, expect: Expect) -> (Vec<String>, Tally) {
    let mut e = Engine::open(path, crate::support::opts(&toolgate::engine::clock::ManualClock::new(0), "checker"))
        .expect("the database opens after the crash");
    check_with(path, expect, &mut e)
}

/// [`check`] with an engine the caller already has open on `path` (its audit is
/// read-only).
pub fn check_with(path: &Path, expect: Expect, e: &mut Engine) -> (Vec<String>, Tally) {
    check_effects_at(path, path, expect, e)
}

/// [`check`] for a ledger whose providers keep their effects in another
/// database (`toolgate provider serve`), with an engine on the ledger that
/// reaches them over HTTP.
pub fn check_effects_at(path: &Path, effects_db: &Path, expect: Expect, e: &mut Engine) -> (Vec<String>, Tally) {
    let mut v = Vec::new();
    let c = RawDb::open(path);
    let ce = RawDb::open(effects_db);
    let ops: Vec<Op> = c
        .rows(
            "SELECT id, tenant, subject, tool, idem_key, state, request_sha256, request_json, downstream_key,
                    receipt_id, result_sha256, result_json, downstream_request_id, resolution,
                    call_provider, call_api_family, call_response_id, call_id, approval_id
             FROM operations ORDER BY id",
            &[],
        )
        .into_iter()
        .map(|r| Op {
            id: r[0].s(),
            tenant: r[1].s(),
            subject: r[2].s(),
            tool: r[3].s(),
            key: r[4].s(),
            state: r[5].s(),
            request_sha256: r[6].s(),
            request_json: r[7].s(),
            downstream_key: r[8].s(),
            receipt_id: r[9].os(),
            result_sha256: r[10].os(),
            result_json: r[11].os(),
            downstream_request_id: r[12].os(),
            resolution: r[13].os(),
            call: (r[14].s(), r[15].s(), r[16].s(), r[17].s()),
            approval_id: r[18].os(),
        })
        .collect();
    let effects: Vec<Effect> = ce
        .rows("SELECT downstream_key, intent, body_sha256, receipt_id FROM provider_effects", &[])
        .into_iter()
        .map(|r| Effect { downstream_key: r[0].s(), intent: r[1].s(), body_sha256: r[2].s(), receipt_id: r[3].s() })
        .collect();
    let mut tally = Tally { effects: effects.len() as i64, ..Tally::default() };
    for op in &ops {
        *tally.states.entry(op.state.clone()).or_default() += 1;
    }

    // 1. No second effect.
    let mut per_intent: HashMap<&str, Vec<&Effect>> = HashMap::new();
    for e in &effects {
        per_intent.entry(e.intent.as_str()).or_default().push(e);
    }
    for (i, es) in &per_intent {
        if es.len() > 1 {
            tally.duplicates += 1;
            v.push(format!("duplicate: intent {} has {} provider effects", &i[..12], es.len()));
        }
    }
    let counted: i64 = ce.rows(
        "SELECT count(*) FROM (SELECT intent FROM provider_effects GROUP BY intent HAVING count(*) > 1) AS d",
        &[],
    )[0][0]
        .i();
    assert_eq!(counted, tally.duplicates, "the checker and SQL agree on duplicates");

    // 2. Every effect belongs to an accepted operation.
    let by_intent: HashMap<String, &Op> =
        ops.iter().map(|o| (intent(&o.tenant, &o.subject, &o.tool, &o.key), o)).collect();
    for e in &effects {
        match by_intent.get(&e.intent) {
            None => v.push(format!("orphan effect: receipt {} belongs to no operation", e.receipt_id)),
            Some(op) if op.downstream_key != e.downstream_key => v.push(format!(
                "foreign key: receipt {} was sent under another key than operation {}'s",
                e.receipt_id, op.id
            )),
            Some(_) => {}
        }
    }

    // 3. Nothing half-written.
    for op in &ops {
        let ob: Option<(String, i64, Option<String>)> = c
            .row("SELECT state, attempt, lease_owner FROM outbox WHERE operation_id = ?1", &[&op.id])
            .map(|r| (r[0].s(), r[1].i(), r[2].os()));
        let Some((ob_state, ob_attempt, _owner)) = ob else {
            v.push(format!("half-written: operation {} has no outbox row", op.id));
            continue;
        };
        let agrees = match op.state.as_str() {
            "accepted" => ob_state == "pending",
            "in_flight" => ob_state == "pending" || ob_state == "leased",
            "succeeded" | "failed" | "resolved" => ob_state == "done",
            "unknown" | "needs_review" => ob_state == "parked",
            _ => false,
        };
        if !agrees {
            v.push(format!("half-written: operation {} is {} with outbox {}", op.id, op.state, ob_state));
        }
        let (n_attempts, open): (i64, i64) = c
            .row(
                "SELECT count(*), count(*) FILTER (WHERE outcome IS NULL) FROM attempts WHERE operation_id = ?1",
                &[&op.id],
            )
            .map(|r| (r[0].i(), r[1].i()))
            .unwrap();
        if n_attempts != ob_attempt {
            v.push(format!("half-written: operation {} counts {ob_attempt} attempts, has {n_attempts}", op.id));
        }
        if open > 1 || (open == 1 && ob_state != "leased") {
            v.push(format!("half-written: operation {} has {open} open attempt(s) with outbox {ob_state}", op.id));
        }
        let bound: Option<String> = c
            .row(
                "SELECT operation_id FROM call_identities WHERE tenant = ?1 AND subject = ?2 AND provider = ?3
                   AND api_family = ?4 AND response_id = ?5 AND call_id = ?6 AND purpose = 'dispatch'",
                &[&op.tenant, &op.subject, &op.call.0, &op.call.1, &op.call.2, &op.call.3],
            )
            .and_then(|r| r[0].os());
        if bound.as_deref() != Some(op.id.as_str()) {
            v.push(format!("half-written: operation {}'s call identity is not bound to it", op.id));
        }
        if let Some(a) = &op.approval_id {
            let ok: Option<String> = c
                .row("SELECT operation_id FROM approvals WHERE id = ?1 AND state = 'approved'", &[a])
                .and_then(|r| r[0].os());
            if ok.as_deref() != Some(op.id.as_str()) {
                v.push(format!("half-written: operation {} names approval {a}, which does not name it back", op.id));
            }
        }
    }
    let approved: Vec<(String, Option<String>)> = c
        .rows("SELECT id, operation_id FROM approvals WHERE state = 'approved'", &[])
        .into_iter()
        .map(|r| (r[0].s(), r[1].os()))
        .collect();
    for (a, op) in approved {
        if !op.as_deref().is_some_and(|id| ops.iter().any(|o| o.id == id)) {
            v.push(format!("half-written: approval {a} is approved but its operation does not exist"));
        }
    }

    // 4. Every succeeded has its evidence; 5. failed means no effect.
    for op in &ops {
        let mine: Vec<&Effect> = effects.iter().filter(|e| e.downstream_key == op.downstream_key).collect();
        match op.state.as_str() {
            "succeeded" => {
                let (Some(receipt), Some(result_sha), Some(result), Some(_req_id)) =
                    (&op.receipt_id, &op.result_sha256, &op.result_json, &op.downstream_request_id)
                else {
                    v.push(format!("evidence: succeeded operation {} lacks result, receipt or request id", op.id));
                    continue;
                };
                if &sha256_hex(result.as_bytes()) != result_sha {
                    v.push(format!("evidence: operation {}'s result digest does not recompute", op.id));
                }
                let row: Option<(String, String, String)> = c
                    .row(
                        "SELECT operation_id, body_sha256, result_sha256 FROM receipts WHERE receipt_id = ?1",
                        &[receipt],
                    )
                    .map(|r| (r[0].s(), r[1].s(), r[2].s()));
                match row {
                    Some((o, body, res)) if o == op.id && body == op.request_sha256 && &res == result_sha => {}
                    Some(_) => v.push(format!("evidence: receipt of operation {} does not match it", op.id)),
                    None => v.push(format!("evidence: succeeded operation {} has no receipts row", op.id)),
                }
                match mine.iter().find(|e| &e.receipt_id == receipt) {
                    Some(e) if e.body_sha256 == op.request_sha256 => {}
                    Some(_) => v.push(format!("evidence: provider recorded another body for operation {}", op.id)),
                    None => v.push(format!("evidence: no provider effect carries operation {}'s receipt", op.id)),
                }
            }
            "failed" if !mine.is_empty() => {
                v.push(format!("failed-with-effect: operation {} failed but the provider committed", op.id));
            }
            "unknown" if expect.queried && !mine.is_empty() => {
                v.push(format!("unqueried: operation {} is unknown although its receipt is visible", op.id));
            }
            _ => {}
        }
    }

    // 6. Business state follows the ledger.
    let world = World::parse(DEMO_WORLD.as_bytes()).unwrap();
    let mut expected: BTreeMap<String, i64> = toolgate::tools::demo::orders_of(&world)
        .unwrap()
        .iter()
        .map(|o| (o.order_ref.clone(), o.refunded_minor))
        .collect();
    for op in ops.iter().filter(|o| o.tool == "create_refund") {
        let counts =
            op.state == "succeeded" || (op.state == "resolved" && op.resolution.as_deref() == Some("succeeded"));
        if counts {
            let req: serde_json::Value = serde_json::from_str(&op.request_json).unwrap();
            let order = req["arguments"]["order_ref"].as_str().unwrap().to_string();
            *expected.entry(order).or_default() += req["arguments"]["amount_minor"].as_i64().unwrap();
        }
    }
    for (order, want) in &expected {
        let got: i64 = c.rows("SELECT refunded_minor FROM orders WHERE order_ref = ?1", &[order])[0][0].i();
        if got != *want {
            v.push(format!("business: order {order} shows {got} refunded, the ledger's successes add up to {want}"));
        }
    }

    // 7. The engine's own audit.
    for f in e.audit().unwrap() {
        v.push(format!("audit: {} {} {}", f.check, f.reference, f.detail));
    }
    let counts = e.counts().unwrap();
    assert_eq!(counts.side_effect_duplicates, tally.duplicates, "counts() and the checker agree");

    // 8. Settled.
    if expect.settled {
        for op in &ops {
            if !SETTLED.contains(&op.state.as_str()) {
                v.push(format!("unsettled: operation {} is still {} after recovery", op.id, op.state));
            }
        }
    }
    (v, tally)
}
