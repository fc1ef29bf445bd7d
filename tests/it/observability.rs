//! Observability (docs/design.md §12): redaction you can prove (a planted canary appears
//! in no table, log or export), a trace that tells the whole story, metrics that
//! parse and count what happened, and percentiles read from the database.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use assert_cmd::Command;
use serde_json::Value;
use toolgate::downstream::FaultPlan;
use toolgate::engine::clock::rfc3339;
use toolgate::engine::envelope::{Code, Delivery, Envelope, Status};
use toolgate::engine::{DispatchRequest, Engine, QueryRequest, Resolution, ResolveRequest};
use toolgate::store::{StoreError, TraceRow};
use toolgate::telemetry::histogram::bucket_upper;
use toolgate::telemetry::metrics::{self, Slice, Window};
use toolgate::telemetry::{export, logging};
use tracing::level_filters::LevelFilter;

use crate::support::{call, code, dispatch_with, raw, refund_args, Fixture, T0};

/// Looks like a live payment-provider key; must never be stored, traced, logged or exported.
const CANARY: &str = "sk_live_CANARY_7f3a91c04e5d";

fn tg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_toolgate"));
    c.env_remove("RUST_BACKTRACE").env_remove("TOOLGATE_LOG").env_remove("TOOLGATE_LOG_LEVEL");
    c
}

/// Runs the CLI at the fixture's time and returns stdout (asserting exit 0).
fn cli(db: &Path, args: &[&str]) -> String {
    let out = tg().args(args).arg("--db").arg(db).args(["--now", &rfc3339(T0)]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn req(tool: &str, args: &str, key: Option<&str>) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: tool.into(),
        arguments: args.as_bytes().to_vec(),
        idempotency_key: key.map(str::to_string),
        ..DispatchRequest::default()
    }
}

fn refund_on(order: &str, key: &str, amount: i64) -> DispatchRequest {
    req("create_refund", &refund_args(order, amount), Some(key))
}

fn query_for(env: &Envelope) -> QueryRequest {
    QueryRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        status_ref: env.status_ref().unwrap().to_string(),
        expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap(),
        ..QueryRequest::default()
    }
}

fn op_id(env: &Envelope) -> String {
    env.protected_audit.operation_id.clone().unwrap()
}

fn approval_id(env: &Envelope) -> String {
    env.protected_audit.approval_id.clone().unwrap()
}

/// Every value of every row of every table, as text (blobs lossily).
pub(crate) fn every_cell(path: &Path) -> Vec<(String, String)> {
    let c = raw(path);
    let tables: Vec<String> = c
        .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut out = Vec::new();
    for t in tables {
        let mut st = c.prepare(&format!("SELECT * FROM \"{t}\"")).unwrap();
        let n = st.column_count();
        let names: Vec<String> = st.column_names().iter().map(|s| (*s).to_string()).collect();
        let rows = st
            .query_map([], |r| {
                let mut cells = Vec::new();
                for i in 0..n {
                    let text = match r.get::<_, rusqlite::types::Value>(i)? {
                        rusqlite::types::Value::Text(s) => s,
                        rusqlite::types::Value::Blob(b) => String::from_utf8_lossy(&b).into_owned(),
                        rusqlite::types::Value::Integer(v) => v.to_string(),
                        rusqlite::types::Value::Real(v) => v.to_string(),
                        rusqlite::types::Value::Null => String::new(),
                    };
                    cells.push(text);
                }
                Ok(cells)
            })
            .unwrap();
        for row in rows {
            for (name, cell) in names.iter().zip(row.unwrap()) {
                out.push((format!("{t}.{name}"), cell));
            }
        }
    }
    out
}

fn contains_bytes(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn a_planted_canary_appears_in_no_table_log_or_export() {
    let fx = Fixture::new();
    let log = fx.path().with_extension("db.test.log");
    let subscriber = logging::file_subscriber(&log, LevelFilter::TRACE).unwrap();
    let mut ops = Vec::new();
    tracing::subscriber::with_default(subscriber, || {
        let mut e = fx.engine();
        // 1. The canary in arguments, every way the contract can refuse it.
        for (tool, args) in [
            (
                "create_refund",
                format!(
                    r#"{{"order_ref":"ord_1002","amount_minor":100,"currency":"EUR","reason":"damaged","api_key":"{CANARY}"}}"#
                ),
            ),
            (
                "create_refund",
                format!(r#"{{"order_ref":"{CANARY}","amount_minor":100,"currency":"EUR","reason":"damaged"}}"#),
            ),
            (
                "create_refund",
                format!(r#"{{"order_ref":"ord_1002","amount_minor":100,"currency":"EUR","reason":"{CANARY}"}}"#),
            ),
            ("create_refund", format!(r#"{{"order_ref":"ord_1002","order_ref":"{CANARY}"}}"#)),
            ("create_refund", format!(r#"{{"order_ref":"{CANARY}""#)),
            ("get_order", format!(r#"{{"order_ref":"ord_1002","authorization":"Bearer {CANARY}"}}"#)),
            ("notify_customer", format!(r#"{{"order_ref":"ord_1002","template":"{CANARY}"}}"#)),
            ("no_such_tool", format!(r#"{{"secret":"{CANARY}"}}"#)),
        ] {
            let env = e.dispatch(&req(tool, &args, Some("canary-key-0001"))).unwrap();
            assert!(matches!(code(&env), Some(Code::InvalidArguments | Code::UnknownTool)), "{tool}: {env:?}");
        }
        // 2. A provider that echoes the credential in an authorization header only:
        // the call succeeds and the caller's data is the clean result.
        let ok =
            dispatch_with(&mut e, &refund_on("ord_1002", "canary-hdr-0001", 1_000), &format!("echo_header({CANARY})"));
        assert_eq!(ok.model_result.status, Status::Succeeded, "{ok:?}");
        assert!(!ok.model_result.data.as_ref().unwrap().to_string().contains(CANARY));
        ops.push(op_id(&ok));
        // 3. ... and in an undeclared result field: the output contract refuses the
        // body, the outcome is unknown, and an explicit query reconciles it from the
        // provider's own (clean) receipt.
        let u = dispatch_with(
            &mut e,
            &refund_on("ord_1002", "canary-res-0001", 1_100),
            &format!("echo_credential({CANARY})"),
        );
        assert_eq!(code(&u), Some(Code::OutputContractViolation));
        let q = e.query_operation_status(&query_for(&u)).unwrap();
        assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled);
        let r = e.dispatch(&refund_on("ord_1002", "canary-res-0001", 1_100)).unwrap();
        assert_eq!(r.model_result.execution.delivery, Delivery::LocalReplay);
        ops.push(op_id(&u));
        // 4. Another one settled by a human.
        let u2 = dispatch_with(
            &mut e,
            &refund_on("ord_1002", "canary-res-0002", 1_200),
            &format!("echo_credential({CANARY})"),
        );
        let out = e
            .resolve(&ResolveRequest {
                operation_id: op_id(&u2),
                resolution: Resolution::Compensated,
                operator: "oncall_olga".into(),
                note: "refunded by hand, then reversed".into(),
                evidence: None,
                seen_version: None,
                action_id: Some("act-canary-1".into()),
                no_evidence: false,
            })
            .unwrap();
        assert!(out.applied, "{out:?}");
        ops.push(op_id(&u2));
        // 5. A provider rejection whose reason text is the canary.
        let rej = dispatch_with(&mut e, &refund_on("ord_1002", "canary-rej-0001", 1_300), &format!("reject({CANARY})"));
        assert_eq!(code(&rej), Some(Code::BusinessRuleViolation));
        ops.push(op_id(&rej));
        // 6. Approvals: an always-approved tool whose provider echoes the credential.
        let notify =
            req("notify_customer", r#"{"order_ref":"ord_1002","template":"refund_issued"}"#, Some("canary-ntf-0001"));
        let a = e.dispatch(&notify).unwrap();
        assert_eq!(code(&a), Some(Code::ApprovalRequired));
        e.set_faults(FaultPlan::parse(&format!("echo_credential({CANARY})")).unwrap());
        let done = e.approve(&approval_id(&a), "bob").unwrap();
        e.set_faults(FaultPlan::none());
        assert_eq!(code(&done), Some(Code::OutputContractViolation));
        ops.push(op_id(&done));
        let mut other = notify.clone();
        other.idempotency_key = Some("canary-ntf-0002".into());
        let a2 = e.dispatch(&other).unwrap();
        assert!(e.deny(&approval_id(&a2), "bob", "not now").unwrap().applied);
        // 7. Status queries with the canary where a status_ref or digest should be.
        let mut bad = query_for(&u);
        bad.status_ref = format!("sr1_{CANARY}");
        assert!(code(&e.query_operation_status(&bad).unwrap()).is_some());
        let mut bad = query_for(&u);
        bad.expected_request_sha256 = CANARY.to_string();
        assert_eq!(code(&e.query_operation_status(&bad).unwrap()), Some(Code::InvalidArguments));
        // 8. Rate limits, retries and a reaper pass for good measure.
        let rl = dispatch_with(&mut e, &refund_on("ord_1002", "canary-rl-00001", 1_400), "rate_limit(100),ok");
        assert_eq!(rl.model_result.status, Status::Succeeded);
        e.reap().unwrap();
        e.work(10).unwrap();
    });

    // The CLI path too: the canary in `--args` and in a provider reply (the
    // process arguments are the only place it exists).
    let db = fx.path();
    let bad_args = format!(
        r#"{{"order_ref":"ord_1002","amount_minor":100,"currency":"EUR","reason":"damaged","token":"{CANARY}"}}"#
    );
    let fault = format!("echo_credential({CANARY})");
    for (key, args, fault, rc) in [
        ("canary-cli-0001", bad_args.as_str(), "ok", 1),
        ("canary-cli-0002", refund_args("ord_1002", 1_500).as_str(), fault.as_str(), 1),
    ] {
        let out = tg()
            .args(["dispatch", "--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--key", key])
            .args(["--args", args, "--fault", fault, "--json", "--now", &rfc3339(T0), "--db"])
            .arg(db)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(rc), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(!String::from_utf8_lossy(&out.stdout).contains(CANARY), "the envelope echoes the canary");
    }
    // The exports, through the real binary (which also logs to `<db>.log`).
    let mut outputs: Vec<(String, String)> = vec![
        ("trace jsonl".into(), cli(db, &["trace", "--format", "jsonl"])),
        ("trace text".into(), cli(db, &["trace"])),
        ("metrics".into(), cli(db, &["metrics"])),
        ("metrics json".into(), cli(db, &["metrics", "--format", "json"])),
        ("audit log".into(), cli(db, &["audit", "--log", "--json"])),
    ];
    for op in &ops {
        outputs.push((format!("ops show {op}"), cli(db, &["ops", "show", op])));
        outputs.push((format!("ops show {op} --json"), cli(db, &["ops", "show", op, "--json"])));
    }
    let cli_log = std::fs::read_to_string(db.with_extension("db.log")).unwrap();
    outputs.push(("test log".into(), std::fs::read_to_string(&log).unwrap()));
    outputs.push(("cli log".into(), cli_log.clone()));

    for (what, text) in &outputs {
        assert!(!text.contains(CANARY), "{what} leaks the canary:\n{text}");
        assert!(!text.contains("Bearer "), "{what} carries an authorization header");
    }
    let leaks: Vec<String> = every_cell(db).into_iter().filter(|(_, v)| v.contains(CANARY)).map(|(c, _)| c).collect();
    assert!(leaks.is_empty(), "the canary is stored in {leaks:?}");
    for f in [db.to_path_buf(), db.with_extension("db-wal")] {
        if let Ok(bytes) = std::fs::read(&f) {
            assert!(!contains_bytes(&bytes, CANARY), "the canary is somewhere in the file {}", f.display());
        }
    }

    // Controls: the scans did look at real content, and can find what is there.
    let cells = every_cell(db);
    assert!(cells.iter().any(|(c, v)| c == "operations.request_json" && v.contains("ord_1002")));
    assert!(cells.iter().any(|(c, _)| c.starts_with("trace_events.")));
    for op in &ops {
        assert!(outputs[0].1.contains(op.as_str()));
    }
    // The in-process log is fed through a thread-scoped `tracing` subscriber,
    // whose callsite interest is cached process-wide: with other tests running in
    // parallel it may receive nothing, so it is scanned for leaks above but not
    // used as the control. The control is the CLI's own `<db>.log`, written by a
    // separate process with its global subscriber: the scan sees real log lines.
    assert!(cli_log.contains("answered"), "the CLI's own dispatches are in <db>.log");
    assert!(cli_log.contains("toolgate::trace"), "the CLI log holds trace lines");
    // Exports name tenants and subjects only by their salted hashes.
    for (what, text) in outputs.iter().filter(|(w, _)| w.starts_with("trace") || w.starts_with("metrics")) {
        for name in ["acme", "agent_ana", "globex"] {
            assert!(!text.contains(name), "{what} names {name}");
        }
    }
    assert!(outputs[0].1.contains("\"tenant_ref\":\"tenant_"));
}

/// Events of the jsonl export, parsed.
fn trace_jsonl(db: &Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["trace", "--format", "jsonl"];
    args.extend_from_slice(extra);
    cli(db, &args).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn the_trace_alone_proves_a_retry_made_no_second_effect() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    let mut first = refund_on("ord_1002", "refund-proof-0001", 2_500);
    first.call = Some(call("call_first"));
    // The first call meets a 429 and succeeds on its second attempt.
    let env = dispatch_with(&mut e, &first, "rate_limit(300),ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    // The model retries the same intent with a new call id.
    let mut retry = first.clone();
    retry.call = Some(call("call_retry"));
    assert_eq!(e.dispatch(&retry).unwrap().model_result.execution.delivery, Delivery::LocalReplay);
    drop(e);

    // Now only the exported trace.
    let events = trace_jsonl(fx.path(), &[]);
    let op = events.iter().find(|t| t["step"] == "accepted").unwrap()["operation_id"].as_str().unwrap().to_string();
    let story: Vec<&Value> = events.iter().filter(|t| t["operation_id"] == op.as_str()).collect();
    let steps: Vec<&str> = story.iter().map(|t| t["step"].as_str().unwrap()).collect();
    assert_eq!(
        steps,
        [
            "accepted",
            "claimed",
            "sent",
            "downstream_reply",
            "claimed",
            "sent",
            "downstream_reply",
            "persisted",
            "idempotency"
        ],
    );
    let sent: Vec<&&Value> = story.iter().filter(|t| t["step"] == "sent").collect();
    let replies: Vec<&&Value> = story.iter().filter(|t| t["step"] == "downstream_reply").collect();
    assert_eq!(sent.len(), 2, "two attempts went out");
    // Exactly one attempt committed downstream: the other was a 429, provably not accepted.
    let commits: Vec<&&&Value> = replies.iter().filter(|t| t["downstream_committed"] == true).collect();
    assert_eq!(commits.len(), 1);
    let commit = commits[0];
    assert_eq!(replies.iter().find(|t| t["downstream_committed"] == false).unwrap()["code"], "RATE_LIMIT");
    let sent_for_commit = sent.iter().filter(|t| t["attempt"] == commit["attempt"]).count();
    assert_eq!(sent_for_commit, 1, "exactly one sent event led to the provider's commit");
    let receipt = commit["receipt_id"].as_str().unwrap();
    // The first call was answered fresh with that receipt; the retry was a replay of it.
    let answers: Vec<&&Value> = story.iter().filter(|t| t["answer"] == "dispatch").collect();
    assert_eq!(answers.len(), 2);
    assert_eq!((answers[0]["step"].as_str(), answers[0]["delivery"].as_str()), (Some("persisted"), Some("fresh")));
    let replay = answers[1];
    assert_eq!(replay["step"], "idempotency");
    assert_eq!(replay["reason"], "replay");
    assert_eq!(replay["delivery"], "local_replay");
    assert_eq!(replay["receipt_id"], receipt);
    assert_eq!(replay["call"]["call_id"], "call_retry");
    assert_eq!(answers[0]["call"]["call_id"], "call_first");
    for k in ["request_sha256", "key_sha256", "tenant_ref", "subject_ref", "tool_version", "call_binding_sha256"] {
        assert!(replay[k].is_string(), "{k} missing on the replay");
        assert_eq!(replay[k], answers[0][k], "{k} differs between the call and its retry");
    }
    // Nothing was sent after the replay.
    let replay_seq = replay["seq"].as_i64().unwrap();
    assert!(sent.iter().all(|t| t["seq"].as_i64().unwrap() < replay_seq));
    // Every event is self-describing: stable names, hashed principals, no raw ids of people.
    for t in &story {
        assert_eq!(t["v"], 1);
        assert!(t["tenant_ref"].as_str().unwrap().starts_with("tenant_"));
        assert!(t["subject_ref"].as_str().unwrap().starts_with("subject_"));
        assert_eq!(t["tool_version"], "1.1.1");
    }
    // `--since` filters by time and `--operation` by operation.
    assert!(trace_jsonl(fx.path(), &["--since", &rfc3339(T0 + 3_600_000)]).is_empty());
    assert_eq!(trace_jsonl(fx.path(), &["--since", &rfc3339(T0)]).len(), events.len());
    assert_eq!(trace_jsonl(fx.path(), &["--operation", &op]).len(), story.len());
    // The people's view tells the same story.
    let text = cli(fx.path(), &["ops", "show", &op]);
    assert!(text.contains("[replay]") && text.contains("downstream committed") && text.contains(receipt), "{text}");
}

/// Every call the engine answers writes exactly one answer event, whatever path
/// it took: the metrics count calls by those events.
#[test]
fn every_call_is_answered_by_exactly_one_event() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    let mut dispatches = 0;
    let mut d = |e: &mut Engine, r: &DispatchRequest, faults: &str| {
        dispatches += 1;
        dispatch_with(e, r, faults)
    };
    d(&mut e, &refund_on("ord_1002", "answer-key-0001", 100), "ok");
    d(&mut e, &refund_on("ord_1002", "answer-key-0001", 100), "ok");
    d(&mut e, &refund_on("ord_1002", "answer-key-0001", 200), "ok");
    d(&mut e, &req("create_refund", "{", Some("answer-key-0002")), "ok");
    d(&mut e, &req("nope", "{}", Some("answer-key-0003")), "ok");
    d(&mut e, &req("get_order", r#"{"order_ref":"ord_1002"}"#, None), "ok");
    d(&mut e, &req("get_order", r#"{"order_ref":"ord_3001"}"#, None), "ok");
    d(&mut e, &refund_on("ord_1003", "answer-key-0004", 100), "ok");
    let u = d(&mut e, &refund_on("ord_1002", "answer-key-0005", 100), "timeout_after_commit");
    d(&mut e, &refund_on("ord_1002", "answer-key-0005", 100), "ok");
    d(
        &mut e,
        &refund_on("ord_1002", "answer-key-0006", 100),
        "unavailable,unavailable,unavailable,unavailable,unavailable",
    );
    d(&mut e, &refund_on("ord_1002", "answer-key-0007", 100), "connect_timeout,ok");
    d(&mut e, &refund_on("ord_1002", "answer-key-0008", 100), "malformed_response");
    d(&mut e, &refund_on("ord_1002", "answer-key-0009", 100), "reject(card_declined)");
    d(&mut e, &refund_on("ord_1002", "answer-key-0010", 100), "rate_limit(999999)");
    let big = d(&mut e, &refund_on("ord_1002", "answer-key-0011", 60_000), "ok");
    d(&mut e, &refund_on("ord_1002", "answer-key-0011", 60_000), "ok");
    let mut queries = 0;
    for q in [query_for(&u), query_for(&u)] {
        queries += 1;
        e.query_operation_status(&q).unwrap();
    }
    let mut bad = query_for(&u);
    bad.expected_request_sha256 = "0".repeat(64);
    queries += 1;
    e.query_operation_status(&bad).unwrap();
    let mut approves = 0;
    for who in ["mallory", "bob", "bob"] {
        approves += 1;
        e.approve(&approval_id(&big), who).unwrap();
    }
    e.revoke("acme", "agent_ana", "create_refund").unwrap();
    d(&mut e, &refund_on("ord_1002", "answer-key-0001", 100), "ok");
    queries += 1;
    e.query_operation_status(&query_for(&u)).unwrap();

    let rows = e.read(|tx| tx.trace_since(0, i64::MIN, 100_000)).unwrap();
    let count = |kind: &str| rows.iter().filter(|t| t.answer.as_deref() == Some(kind)).count();
    assert_eq!((count("dispatch"), count("query"), count("approve")), (dispatches, queries, approves));
    // Answers carry the call's latency; every operation event carries the principal hashes.
    assert!(rows.iter().filter(|t| t.answer.is_some()).all(|t| t.latency_us.is_some_and(|l| l >= 0)));
    for t in rows.iter().filter(|t| t.operation_id.is_some()) {
        let f: Value = serde_json::from_str(&t.fields).unwrap();
        assert!(t.tenant_ref.is_some() && f["subject_ref"].is_string(), "{} lacks principal hashes", t.step);
        assert!(t.tool_version.is_some() && f["request_sha256"].is_string(), "{} lacks revisions or digest", t.step);
    }
}

/// Checks the text against the exposition format with a real parser, and more
/// strictly than it does: every line is a comment or a sample, every sample's
/// family has a TYPE, counters end in `_total`, histograms are cumulative.
fn parse_prometheus(text: &str) -> prometheus_parse::Scrape {
    use prometheus_parse::LineInfo;
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    for line in text.lines() {
        match LineInfo::parse(line) {
            LineInfo::Type { metric_name, metric_alias, sample_type } => {
                let name = metric_alias.unwrap_or(metric_name);
                assert!(name.starts_with("toolgate_"), "{name}");
                let kind = format!("{sample_type:?}");
                if kind == "Counter" {
                    assert!(name.ends_with("_total"), "counter {name} must end in _total");
                }
                assert!(types.insert(name, kind).is_none(), "TYPE twice: {line}");
            }
            LineInfo::Doc { .. } | LineInfo::Empty => {}
            LineInfo::Sample { metric_name, value, .. } => {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| {
                        metric_name.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|k| k == "Histogram"))
                    })
                    .unwrap_or(metric_name);
                assert!(types.contains_key(family), "sample before its TYPE: {line}");
                let v: f64 = value.parse().unwrap_or_else(|_| panic!("bad value: {line}"));
                // Every sample is a count or a duration, except a signed offset.
                assert!(v.is_finite() && (v >= 0.0 || metric_name == "toolgate_clock_offset_ms"), "{line}");
            }
            LineInfo::Ignored => assert!(line.starts_with("# "), "not the exposition format: {line:?}"),
        }
    }
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    for s in &scrape.samples {
        if let prometheus_parse::Value::Histogram(buckets) = &s.value {
            assert!(buckets.windows(2).all(|w| w[0].less_than < w[1].less_than && w[0].count <= w[1].count), "{s:?}");
            let inf = buckets.last().unwrap();
            assert!(inf.less_than.is_infinite());
            let count = scrape
                .samples
                .iter()
                .find(|c| c.metric == format!("{}_count", s.metric) && *c.labels == *s.labels)
                .unwrap();
            assert!(matches!(count.value, prometheus_parse::Value::Untyped(n) if (n - inf.count).abs() < 1e-9));
        }
    }
    scrape
}

/// The sum of the matching samples (counts, so whole numbers).
fn sample_sum(scrape: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> i64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(b) => b.last().map_or(0.0, |h| h.count),
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum::<f64>()
        .round() as i64
}

#[test]
fn prometheus_output_parses_and_counts_what_happened() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    for i in 0..3 {
        dispatch_with(&mut e, &refund_on("ord_1002", &format!("prom-key-000{i}"), 100), "ok");
    }
    dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0000", 100), "ok"); // replay
    dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0000", 999), "ok"); // conflict
    dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0010", 100), "rate_limit(100),ok");
    let u = dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0011", 100), "timeout_after_commit");
    let u2 = dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0012", 100), "receipt_delay(60000)");
    e.query_operation_status(&query_for(&u)).unwrap();
    e.query_operation_status(&query_for(&u2)).unwrap();
    dispatch_with(
        &mut e,
        &refund_on("ord_1002", "prom-key-0013", 100),
        "connect_timeout,connect_timeout,connect_timeout,connect_timeout,connect_timeout",
    );
    let big = dispatch_with(&mut e, &refund_on("ord_1002", "prom-key-0014", 60_000), "ok");
    e.deny(&approval_id(&big), "bob", "too large").unwrap();
    let mut gus = refund_on("ord_3001", "prom-key-0015", 100);
    gus.tenant = "globex".into();
    gus.subject = "agent_gus".into();
    gus.arguments =
        r#"{"order_ref":"ord_3001","amount_minor":100,"currency":"GBP","reason":"other"}"#.as_bytes().to_vec();
    dispatch_with(&mut e, &gus, "ok");
    dispatch_with(&mut e, &req("get_order", r#"{"order_ref":"ord_3001"}"#, None), "ok"); // not acme's: NOT_FOUND
    drop(e);

    let text = cli(fx.path(), &["metrics"]);
    let scrape = parse_prometheus(&text);
    let m = |name: &str, labels: &[(&str, &str)]| sample_sum(&scrape, name, labels);
    assert_eq!(m("toolgate_dispatches_total", &[]), 12);
    assert_eq!(m("toolgate_dispatches_total", &[("code", "OK"), ("delivery", "fresh")]), 5);
    assert_eq!(m("toolgate_dispatches_total", &[("outcome", "unknown")]), 2);
    assert_eq!(m("toolgate_idempotency_hits_total", &[("result", "replay")]), 1);
    assert_eq!(m("toolgate_idempotency_conflicts_total", &[("kind", "idempotency_key")]), 1);
    assert_eq!(m("toolgate_approvals_required_total", &[]), 1);
    assert_eq!(m("toolgate_approval_decisions_total", &[("decision", "denied")]), 1);
    assert_eq!(m("toolgate_approval_requests", &[("state", "denied")]), 1);
    assert_eq!(m("toolgate_auth_denied_total", &[("code", "NOT_FOUND")]), 1);
    assert_eq!(m("toolgate_timeouts_total", &[("stage", "connect")]), 5);
    assert_eq!(m("toolgate_timeouts_total", &[("stage", "response")]), 2);
    assert_eq!(m("toolgate_outcome_unknown_total", &[]), 2);
    assert_eq!(m("toolgate_reconciliations_total", &[("result", "reconciled")]), 1);
    assert_eq!(m("toolgate_reconciliations_total", &[("result", "not_found")]), 1);
    assert_eq!(m("toolgate_rate_limits_total", &[]), 1);
    assert_eq!(m("toolgate_retries_total", &[]), 5);
    assert_eq!(m("toolgate_retry_exhausted_total", &[("limit", "attempts")]), 1);
    assert_eq!(m("toolgate_operations_open", &[("state", "unknown")]), 1);
    assert_eq!(m("toolgate_side_effect_duplicates", &[]), 0);
    assert_eq!(m("toolgate_call_duration_seconds", &[("call", "dispatch"), ("tool", "create_refund")]), 11);
    assert_eq!(m("toolgate_call_duration_seconds", &[("call", "query")]), 2);
    // Sliceable: by tenant (hashed), risk and version.
    let tenants: Vec<&str> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "toolgate_dispatches_total")
        .filter_map(|s| s.labels.get("tenant"))
        .collect();
    assert!(tenants.iter().all(|t| t.starts_with("tenant_") || *t == "none"), "{tenants:?}");
    assert_eq!(m("toolgate_dispatches_total", &[("risk", "high"), ("version", "1.1.1")]), 11);
    assert_eq!(m("toolgate_dispatches_total", &[("risk", "low")]), 1);
    let globex = cli(fx.path(), &["metrics", "--tenant", "globex"]);
    assert_eq!(sample_sum(&parse_prometheus(&globex), "toolgate_dispatches_total", &[]), 1);
    // The retry budget and the breaker are exported, nothing is declared missing.
    assert!(text.contains("toolgate_retry_budget_tokens{"), "{text}");
    assert!(text.contains("toolgate_circuit_state{"), "{text}");
    assert!(!text.contains("is not exported"), "{text}");
    // JSON: the same snapshot with rates per minute and percentiles per tool.
    let j: Value =
        serde_json::from_str(&cli(fx.path(), &["metrics", "--format", "json", "--window-minutes", "5"])).unwrap();
    let rate = j["rates"].as_array().unwrap().iter().find(|r| r["name"] == "dispatches").unwrap();
    assert_eq!(rate["counts"].as_array().unwrap().len(), 5);
    assert_eq!(rate["total"], 12);
    assert_eq!(j["outcome_unknown"], 1);
    assert_eq!(j["side_effect_duplicates"], 0);
    let lat = j["latency_window"].as_array().unwrap().iter().find(|t| t["tool"] == "create_refund").unwrap();
    assert_eq!(lat["count"], 11);
    assert!(lat["percentiles"]["p50_us"].as_i64().unwrap() <= lat["percentiles"]["p99_us"].as_i64().unwrap());
}

#[test]
fn percentiles_read_from_the_database_match_a_known_distribution() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    // Known latencies, written as answer events exactly as the engine writes them.
    let old = T0 - 3 * 3_600_000;
    toolgate::store::Store::open(fx.path(), toolgate::store::OpenOptions::default())
        .unwrap()
        .write(|tx| -> Result<(), StoreError> {
            let ev = |at: i64, tool: &str, latency_us: i64| {
                tx.insert_trace(&TraceRow {
                    seq: 0,
                    at,
                    operation_id: None,
                    step: "persisted".into(),
                    tool: Some(tool.into()),
                    code: None,
                    outcome: Some("committed".into()),
                    delivery: Some("fresh".into()),
                    attempt: Some(1),
                    duration_us: None,
                    fields: "{}".into(),
                    answer: Some("dispatch".into()),
                    latency_us: Some(latency_us),
                    tenant_ref: Some("tenant_0000000000000000".into()),
                    tool_version: Some("1.1.1".into()),
                    timeout_stage: None,
                    reason: Some("committed".into()),
                })
            };
            for v in 1..=1000 {
                ev(T0, "create_refund", v)?;
            }
            for v in 1_000..10_000 {
                ev(T0 - 60_000, "notify_customer", v)?;
            }
            // Three hours ago: in the all-time figures, outside a 15-minute window.
            for _ in 0..9_000 {
                ev(old, "create_refund", 2_000_000)?;
            }
            Ok(())
        })
        .unwrap();
    let snap = metrics::snapshot(&mut e, Window::last_minutes(15), &Slice::default()).unwrap();
    let p = |list: &[metrics::ToolLatency], tool: &str| {
        let t = list.iter().find(|t| t.tool == tool).unwrap();
        let p = t.percentiles.unwrap();
        (t.count, p.p50_us, p.p95_us, p.p99_us)
    };
    assert_eq!(p(&snap.latency_window, "create_refund"), (1_000, 500, 950, 990));
    assert_eq!(p(&snap.latency_window, "notify_customer"), (9_000, 5_500, 9_550, 9_910));
    // All time: 1000 fast calls and 9000 at 2 s: the median is in the slow mode.
    assert_eq!(p(&snap.latency_all_time, "create_refund"), (10_000, 2_000_000, 2_000_000, 2_000_000));
    let rate = snap.rate("dispatches").unwrap();
    assert_eq!((rate.total, rate.counts[13], rate.counts[14]), (10_000, 9_000, 1_000));
    // The histogram's +Inf and sum agree with the events.
    let h = snap.family("toolgate_call_duration_seconds").unwrap();
    let refund = h.samples.iter().find(|s| s.labels.get("tool").map(String::as_str) == Some("create_refund")).unwrap();
    let hist = refund.histogram.as_ref().unwrap();
    assert_eq!(hist.count, 10_000);
    assert!((hist.sum_seconds - (500_500.0 + 9_000.0 * 2_000_000.0) / 1e6).abs() < 1e-6);
    assert_eq!(hist.buckets.iter().find(|(le, _)| (*le - 0.0005).abs() < 1e-12).unwrap().1, 500);

    // The SQL bucketing of the rollup trigger is the Rust rule, edge cases included.
    let edges = [0, 1, 999, 1_000, 1_001, 9_991, 12_345, 250_001, 999_999, 1_000_001, 999_999_999, 1_234_567_890];
    toolgate::store::Store::open(fx.path(), toolgate::store::OpenOptions::default())
        .unwrap()
        .write(|tx| -> Result<(), StoreError> {
            for (i, v) in edges.iter().enumerate() {
                tx.insert_trace(&TraceRow {
                    seq: 0,
                    at: T0,
                    operation_id: None,
                    step: "read".into(),
                    tool: Some(format!("edge_{i}")),
                    code: None,
                    outcome: None,
                    delivery: None,
                    attempt: None,
                    duration_us: None,
                    fields: "{}".into(),
                    answer: Some("dispatch".into()),
                    latency_us: Some(*v),
                    tenant_ref: None,
                    tool_version: None,
                    timeout_stage: None,
                    reason: None,
                })?;
            }
            Ok(())
        })
        .unwrap();
    // (A closure, not the method path: `Tx<'_>`'s lifetime must stay higher-ranked.)
    #[allow(clippy::redundant_closure_for_method_calls)]
    let rows = e.read(|tx| tx.latency_totals()).unwrap();
    for (i, v) in edges.iter().enumerate() {
        let row = rows.iter().find(|r| r.tool == format!("edge_{i}")).unwrap();
        assert_eq!(row.bucket_us, bucket_upper(*v), "latency {v}");
    }
}

/// `toolgate metrics --listen ADDR` on a ledger; stopped (killed) on drop.
struct MetricsListener {
    child: std::process::Child,
    addr: std::net::SocketAddr,
}

impl MetricsListener {
    fn start(db: &Path) -> Self {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_toolgate"))
            .args(["metrics", "--listen", "127.0.0.1:0", "--db"])
            .arg(db)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        let url = first.trim().strip_prefix("listening on http://").unwrap_or_else(|| panic!("{first}"));
        let addr = url.trim_end_matches("/metrics").parse().unwrap();
        Self { child, addr }
    }
}

impl Drop for MetricsListener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange (`Connection: close`): status and body.
fn http_exchange(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let status = reply.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{reply}"));
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    // Bodies arrive chunked or with a length; a scrape's text has no CRLF of its own.
    let body = if reply.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_string()
    };
    (status, body)
}

#[test]
fn metrics_endpoint_serves_scrapes_and_stops() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    dispatch_with(&mut e, &refund_on("ord_1002", "http-key-0001", 100), "ok");
    drop(e);
    // The real binary: `--listen 127.0.0.1:0` says where it listens and serves
    // on the same HTTP stack as `serve`.
    let m = MetricsListener::start(fx.path());
    let (status, body) = http_exchange(m.addr, "GET", "/metrics");
    assert_eq!(status, 200);
    assert_eq!(sample_sum(&parse_prometheus(&body), "toolgate_dispatches_total", &[]), 1);
    assert_eq!(http_exchange(m.addr, "GET", "/nope").0, 404);
    assert_eq!(http_exchange(m.addr, "POST", "/metrics").0, 405);
    // SIGTERM stops it (exit 0).
    let mut m = m;
    assert!(std::process::Command::new("kill").args(["-TERM", &m.child.id().to_string()]).status().unwrap().success());
    assert!(m.child.wait().unwrap().success());
}

#[test]
fn exported_events_have_stable_names_and_text_lines_tell_the_step() {
    let row = TraceRow {
        seq: 7,
        at: T0,
        operation_id: Some("op_1".into()),
        step: "downstream_reply".into(),
        tool: Some("create_refund".into()),
        code: Some("RATE_LIMIT".into()),
        outcome: Some("not_started".into()),
        delivery: None,
        attempt: Some(1),
        duration_us: Some(1_500),
        fields:
            r#"{"retry_after_ms":300,"note":"provably not received: retry after backoff","downstream_committed":false}"#
                .into(),
        answer: None,
        latency_us: None,
        tenant_ref: Some("tenant_ab".into()),
        tool_version: Some("1.1.1".into()),
        timeout_stage: None,
        reason: Some("retry_scheduled".into()),
    };
    let v = export::event_json(&row);
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    for k in [
        "v",
        "seq",
        "at",
        "at_ms",
        "step",
        "operation_id",
        "tool",
        "tool_version",
        "tenant_ref",
        "answer",
        "code",
        "outcome",
        "delivery",
        "reason",
        "timeout_stage",
        "attempt",
        "duration_us",
        "latency_us",
        "retry_after_ms",
    ] {
        assert!(keys.contains(&k), "{k} missing from {keys:?}");
    }
    assert_eq!(v["at"], "2026-01-01T00:00:00.000Z");
    assert_eq!(v["answer"], Value::Null);
    let line = export::text_line(&row);
    assert!(
        line.contains("[retry_scheduled]") && line.contains("retry after 300 ms") && line.contains("took 1.5 ms"),
        "{line}"
    );
}

#[test]
fn a_slow_client_and_idle_connections_cannot_stall_a_scrape() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let fx = Fixture::new();
    let m = MetricsListener::start(fx.path());
    let addr = m.addr;
    // Ten idle connections and one client trickling its request head a byte at a time.
    let idle: Vec<_> = (0..10).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    let trickling = std::sync::Arc::new(AtomicBool::new(true));
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let slow = {
        let (trickling, done) = (trickling.clone(), done.clone());
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            // Bounded: at most 100 bytes, 300 ms apart; stops once the scrape is done.
            for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n".iter().cycle().take(100) {
                if done.load(Ordering::SeqCst) || std::io::Write::write_all(&mut s, &[*b]).is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            trickling.store(false, Ordering::SeqCst);
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (status, _) = http_exchange(addr, "GET", "/metrics");
    assert_eq!(status, 200);
    assert!(trickling.load(Ordering::SeqCst), "the scrape waited for the slow client to finish");
    done.store(true, Ordering::SeqCst);
    slow.join().unwrap();
    drop(idle);
}
