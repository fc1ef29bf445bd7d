//! One function per remaining command, each taking the command's own
//! arguments: `demo-db`, `mcp`, `init`, `dispatch`, `query`, `approve`,
//! `deny`, `approvals`, `resolve`, `ops`, `provider serve`, `counts`,
//! `grant`/`revoke`, `orders`, `reap`, `clock`, `work`, `bench`, `audit`.

use std::path::Path;

use serde_json::{json, Value};

use super::{
    db_path, engine_options, fmt_map, open, open_read, print_detail, print_envelope, print_json, print_outcome,
    projection, provider_serve_db, read_args, trace_json, Cli, CliError, Command, DispatchArgs, GrantArgs, OpsCommand,
    ProviderCommand, QueryArgs, ResolveArgs, ResolveAs,
};
use crate::cli::args::CatalogCommand;
use crate::downstream::FaultPlan;
use crate::engine::clock::rfc3339;
use crate::engine::contracts::ContractError;
use crate::engine::projection::QUERY_STATUS_TOOL;
use crate::engine::world::World;
use crate::engine::{DispatchRequest, Engine, QueryRequest, Resolution, ResolveRequest};
use crate::store::Location;
use crate::tools::demo::DEMO_WORLD;

pub(super) fn demo_db(out: &Path, seed: u64, json: bool) -> Result<i32, CliError> {
    crate::demo::generate(out, seed)?;
    if json {
        outln!("{}", json!({"written": true, "seed": seed, "schema_version": crate::store::SCHEMA_VERSION}));
    } else {
        outln!("demo database written (seed {seed})");
    }
    Ok(0)
}

pub(super) fn mcp(cli: &Cli, token: &str, concurrency: usize, queue: usize, grace_ms: u64) -> Result<i32, CliError> {
    // A queue of 0 would refuse a call whenever no engine happens to be
    // waiting at that instant, even between two calls of a calm session.
    if !(1..=64).contains(&concurrency) || !(1..=4096).contains(&queue) || grace_ms > 60_000 {
        return Err(CliError::new(
            "USAGE",
            "--concurrency must be 1 to 64, --queue 1 to 4096, --grace-ms at most 60000",
        ));
    }
    let path = db_path(cli)?;
    let opts = crate::mcp::StdioOptions {
        workers: (0..concurrency).map(|_| engine_options(cli)).collect::<Result<_, _>>()?,
        lane: engine_options(cli)?,
        queue,
        grace: std::time::Duration::from_millis(grace_ms),
    };
    // Diagnostics go to `<db>.log`: standard output is the protocol.
    crate::telemetry::logging::init_for_db(path);
    crate::mcp::serve_stdio(path, token, opts).map_err(CliError::from)?;
    Ok(0)
}

pub(super) fn init(cli: &Cli, world: Option<&Path>, json: bool) -> Result<i32, CliError> {
    let path = db_path(cli)?;
    let text = match world {
        Some(f) => std::fs::read(f)
            .map_err(|e| CliError::new("WORLD_UNREADABLE", format!("cannot read the world file: {}", e.kind())))?,
        None => DEMO_WORLD.as_bytes().to_vec(),
    };
    // Refusals name the file as the user knows it (its name, never a resolved path).
    let name = world
        .and_then(Path::file_name)
        .map_or_else(|| "the built-in world".to_string(), |n| n.to_string_lossy().into_owned());
    // The catalog loads (or is refused) before anything is created, and
    // the toolset's domains check their own sections (the demo's orders).
    let opts = engine_options(cli)?;
    let w = World::parse_checked(&name, &text, &opts.toolset)?;
    let file = !Location::is_postgres(path);
    if let Some(parent) = path.parent().filter(|p| file && !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(CliError::new(
                "DB_OPEN_FAILED",
                "cannot open the database: the parent directory does not exist",
            ));
        }
    }
    let existed = !file || path.exists();
    let mut engine = Engine::create(path, opts)?;
    if let Err(e) = engine.load_world(&w) {
        drop(engine);
        if !existed {
            let _ = std::fs::remove_file(path);
            let _ = std::fs::remove_file(path.with_extension("db-wal"));
        }
        return Err(e.into());
    }
    let orders = crate::tools::demo::orders_of(&w).map_or(0, |o| o.len());
    let summary =
        json!({"tenants": w.tenants.len(), "subjects": w.subjects.len(), "grants": w.grants.len(), "orders": orders});
    if json {
        print_json(&json!({"initialized": true, "world": summary}));
    } else {
        outln!(
            "initialized: {} tenants, {} subjects, {} grants, {} orders",
            w.tenants.len(),
            w.subjects.len(),
            w.grants.len(),
            orders
        );
    }
    Ok(0)
}

pub(super) fn dispatch(cli: &Cli, a: &DispatchArgs) -> Result<i32, CliError> {
    let project = projection(a.project.as_deref())?;
    let arguments = read_args(a)?;
    let mut engine = open(cli)?;
    if let Some(f) = &a.fault {
        engine.set_faults(FaultPlan::parse(f).map_err(|e| CliError::new("BAD_FAULT", e.to_string()))?);
    }
    let call = a.call.identity();
    let call_id = call.call_id.clone();
    let env = engine.dispatch(&DispatchRequest {
        tenant: a.tenant.clone(),
        subject: a.subject.clone(),
        tool: a.tool.clone(),
        arguments,
        idempotency_key: a.key.clone(),
        call: Some(call),
        approval_id: a.approval_id.clone(),
        deadline_ms: a.deadline_ms,
        token_id: None,
    })?;
    match project {
        Some(p) => print_json(&p.render(&call_id, &a.tool, &env.model_result)),
        None => print_envelope(&env, a.json),
    }
    Ok(env.exit_code())
}

pub(super) fn query(cli: &Cli, a: &QueryArgs) -> Result<i32, CliError> {
    let project = projection(a.project.as_deref())?;
    let mut engine = open(cli)?;
    let call = a.call.identity();
    let call_id = call.call_id.clone();
    let env = engine.query_operation_status(&QueryRequest {
        tenant: a.tenant.clone().unwrap_or_default(),
        subject: a.subject.clone().unwrap_or_default(),
        status_ref: a.status_ref.clone().unwrap_or_default(),
        expected_request_sha256: a.expect_sha256.clone().unwrap_or_default(),
        idempotency_key: a.key.clone(),
        call: Some(call),
        operator: cli.operator.clone(),
    })?;
    match project {
        Some(p) => print_json(&p.render(&call_id, QUERY_STATUS_TOOL, &env.model_result)),
        None => print_envelope(&env, a.json),
    }
    Ok(env.exit_code())
}

pub(super) fn approve(cli: &Cli, approval_id: Option<&str>, approver: &str, json: bool) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let env = engine.approve(approval_id.unwrap_or_default(), approver)?;
    print_envelope(&env, json);
    Ok(env.exit_code())
}

pub(super) fn deny(
    cli: &Cli,
    approval_id: Option<&str>,
    approver: &str,
    note: &str,
    json: bool,
) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let out = engine.deny(approval_id.unwrap_or_default(), approver, note)?;
    print_outcome(&out, json);
    Ok(i32::from(!out.applied))
}

pub(super) fn approvals(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open_read(cli)?;
    let now = engine.clock().now_ms();
    let rows = engine.pending_approvals(1000)?;
    let list: Vec<Value> = rows
        .iter()
        .map(|a| {
            json!({
                "approval_id": a.id, "tool": a.tool, "tenant": a.tenant, "subject": a.subject,
                "amount_minor": crate::engine::approval_amount(a), "created_at": rfc3339(a.created_at),
                "expires_at": rfc3339(a.expires_at), "expires_in_ms": a.expires_at - now,
                "expired": now >= a.expires_at, "request_sha256": a.request_sha256,
            })
        })
        .collect();
    if json {
        print_json(&json!({"pending": list}));
    } else if list.is_empty() {
        outln!("no pending approvals");
    } else {
        outln!("{:<30} {:<16} {:<8} {:<12} {:>12}  expires in", "approval", "tool", "tenant", "subject", "amount");
        for a in &rows {
            let left = a.expires_at - now;
            let exp = if left <= 0 { "expired".to_string() } else { format!("{}s", left / 1000) };
            outln!(
                "{:<30} {:<16} {:<8} {:<12} {:>12}  {exp}",
                a.id,
                a.tool,
                a.tenant,
                a.subject,
                crate::engine::approval_amount(a).map_or("-".into(), |v| v.to_string())
            );
        }
    }
    Ok(0)
}

pub(super) fn resolve(cli: &Cli, a: &ResolveArgs) -> Result<i32, CliError> {
    let operator = cli
        .operator
        .clone()
        .ok_or_else(|| CliError::new("OPERATOR_REQUIRED", "--operator NAME is required to resolve"))?;
    let mut engine = open(cli)?;
    let req = ResolveRequest {
        operation_id: a.operation_id.clone().unwrap_or_default(),
        resolution: match a.resolution {
            ResolveAs::Succeeded => Resolution::Succeeded,
            ResolveAs::Failed => Resolution::Failed,
            ResolveAs::Compensated => Resolution::Compensated,
        },
        operator,
        note: a.act.note.clone(),
        evidence: a.evidence.clone(),
        seen_version: a.act.seen_version,
        action_id: a.act.action_id.clone(),
        no_evidence: a.no_evidence,
    };
    let out = if a.against_evidence { engine.resolve_against_evidence(&req)? } else { engine.resolve(&req)? };
    print_outcome(&out, a.act.json);
    Ok(i32::from(!out.applied))
}

pub(super) fn counts(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open_read(cli)?;
    let c = engine.counts()?;
    if json {
        print_json(&c);
    } else {
        outln!("operations: {}", fmt_map(&c.operations));
        outln!("outbox:     {}", fmt_map(&c.outbox));
        let (counted, not): (Vec<_>, Vec<_>) = c.downstreams.iter().partition(|(_, d)| d.counted);
        let names = |v: &[(&String, &crate::engine::DownstreamEffects)]| {
            v.iter().map(|(n, _)| crate::display::escape(n)).collect::<Vec<_>>().join(", ")
        };
        let scope = match (counted.is_empty(), not.is_empty()) {
            (_, true) => String::new(),
            (true, false) => format!(" (counted at no downstream: not at {})", names(&not)),
            (false, false) => format!(" (counted at {} only; not at {})", names(&counted), names(&not)),
        };
        outln!("downstream effects: {}{scope}", c.downstream_effects);
        outln!("side_effect_duplicates: {}{scope}", c.side_effect_duplicates);
        for (name, d) in &c.downstreams {
            match (d.effects, d.side_effect_duplicates, &d.note) {
                (Some(e), Some(dups), _) => {
                    outln!("  {:<16} {:<10} effects {e}, duplicates {dups}", crate::display::escape(name), d.adapter);
                }
                (.., note) => outln!(
                    "  {:<16} {:<10} not counted: {}",
                    crate::display::escape(name),
                    crate::display::escape(&d.adapter),
                    crate::display::escape(note.as_deref().unwrap_or(""))
                ),
            }
        }
        outln!("pending approvals: {}", c.pending_approvals);
        if let Some(clock) = &c.clock {
            outln!(
                "clock: {:?}, this host {} ms off ledger time{}",
                clock.source,
                clock.offset_ms,
                clock.paused.as_deref().map(|w| format!("; PAUSED: {w}")).unwrap_or_default()
            );
        }
    }
    Ok(0)
}

pub(super) fn grant_or_revoke(cli: &Cli, g: &GrantArgs, command: &Command) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let grant = matches!(command, Command::Grant(_));
    let changed = if grant {
        engine.grant(&g.tenant, &g.subject, &g.tool)?
    } else {
        engine.revoke(&g.tenant, &g.subject, &g.tool)?
    };
    let what = if grant { "granted" } else { "revoked" };
    if g.json {
        print_json(&json!({"action": what, "changed": changed}));
    } else {
        outln!("{what}{}", if changed { "" } else { " (no change)" });
    }
    Ok(0)
}

pub(super) fn orders(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open_read(cli)?;
    let orders = crate::tools::demo::orders(&mut engine)?;
    // What accepted refunds that may still take effect hold of each order.
    let mut held: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    for (_, resource, amount) in engine.holds()? {
        *held.entry(resource).or_default() += amount;
    }
    let held_of =
        |o: &crate::tools::demo::OrderRow| held.get(&crate::tools::demo::resource(&o.order_ref)).copied().unwrap_or(0);
    if json {
        let rows: Vec<Value> = orders
            .iter()
            .map(|o| {
                let mut v = json!(o);
                v["held_minor"] = json!(held_of(o));
                v["remaining_minor"] = json!(o.captured_minor - o.refunded_minor - held_of(o));
                v
            })
            .collect();
        print_json(&json!({"orders": rows}));
    } else {
        outln!(
            "{:<12} {:<8} {:<12} {:<4} {:>10} {:>10} {:>10} {:>10}  status",
            "order",
            "tenant",
            "owner",
            "cur",
            "captured",
            "refunded",
            "held",
            "remaining"
        );
        for o in &orders {
            outln!(
                "{:<12} {:<8} {:<12} {:<4} {:>10} {:>10} {:>10} {:>10}  {}{}",
                o.order_ref,
                o.tenant,
                o.owner,
                o.currency,
                o.captured_minor,
                o.refunded_minor,
                held_of(o),
                o.captured_minor - o.refunded_minor - held_of(o),
                o.status,
                if o.over_refunded_minor > 0 {
                    format!("  PAID {} ABOVE THE CAPTURE", o.over_refunded_minor)
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(0)
}

pub(super) fn reap(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let r = engine.reap()?;
    // Ctrl-C stops the purge between two batches (each its own transaction).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    stop_on_interrupt(&stop);
    let p = engine.purge_expired_until(&stop)?;
    let paused = r.clock_paused.clone().or_else(|| p.clock_paused.clone());
    if json {
        print_json(&json!({
            "requeued_unsent": r.requeued_unsent, "requeued_same_key": r.requeued_same_key,
            "parked_unknown": r.parked_unknown, "purged": p.purged, "kept_for_audit": p.kept_for_audit, "bytes_reclaimed": p.bytes_reclaimed,
            "clock_paused": paused, "interrupted": p.interrupted,
        }));
    } else if let Some(why) = &paused {
        outln!("reap paused, nothing done: {why}");
    } else {
        outln!(
            "reaped: {} back to accepted (never sent), {} re-queued with the same downstream key, {} parked as unknown; {} purged past retention (tombstones kept), {} past retention kept because a person acted on them",
            r.requeued_unsent, r.requeued_same_key, r.parked_unknown, p.purged, p.kept_for_audit
        );
    }
    if p.interrupted {
        eprintln!("reap: interrupted between batches; {} purged, the rest waits for the next pass", p.purged);
        return Ok(130);
    }
    // A pass that could not act is not a success a script may ignore.
    Ok(i32::from(paused.is_some()))
}

pub(super) fn vacuum(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let (before, after) = engine.vacuum()?;
    if json {
        print_json(
            &json!({"bytes_before": before, "bytes_after": after, "bytes_reclaimed": before.saturating_sub(after)}),
        );
    } else {
        outln!(
            "vacuumed: {before} bytes -> {after} bytes ({} given back); space comes back after each purge from now on",
            before.saturating_sub(after)
        );
    }
    Ok(0)
}

/// Sets `stop` at the first SIGINT (Ctrl-C) or SIGTERM, from a thread of its
/// own; the work checks it at its next safe point.
fn stop_on_interrupt(stop: &std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let stop = stop.clone();
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        // The servers' own signal (SIGINT or SIGTERM); none to wait for if it
        // cannot be registered.
        let signalled = rt.block_on(async {
            let Ok(signal) = toolgate_server::shutdown::shutdown_signal() else { return false };
            signal.await;
            true
        });
        if !signalled {
            return;
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // A second one ends the process at once (the work may be waiting on
        // the database).
        rt.block_on(async {
            let _ = tokio::signal::ctrl_c().await;
        });
        std::process::exit(130);
    });
}

pub(super) fn clock(cli: &Cli, accept: bool, json: bool) -> Result<i32, CliError> {
    let mut engine = if accept { open(cli)? } else { open_read(cli)? };
    let status = if accept { Some(engine.accept_host_clock()?) } else { engine.clock_status() };
    let Some(st) = status else {
        return Err(CliError::from(crate::engine::EngineError::invalid(
            "CLOCK_MANUAL",
            "this command runs on a manual clock (--now): there is no ledger clock to show",
        )));
    };
    if json {
        print_json(&st);
    } else {
        outln!(
            "ledger time: {} ({}); this host's wall clock is {} ms off it, uncertainty {} ms",
            rfc3339(engine.clock().now_ms()),
            match st.source {
                crate::engine::ledger_clock::ClockSource::Database => "the database server's clock",
                crate::engine::ledger_clock::ClockSource::Anchor => "this host's anchor in the ledger",
            },
            st.offset_ms,
            st.uncertainty_ms
        );
        match &st.paused {
            Some(why) => outln!("paused: {why}"),
            None => outln!("reaping and purging: running"),
        }
    }
    Ok(i32::from(st.paused.is_some()))
}

pub(super) fn work(cli: &Cli, json: bool) -> Result<i32, CliError> {
    let mut engine = open(cli)?;
    let n = engine.work(10_000)?;
    let settled = engine.settle_unknown(10_000)?;
    if json {
        print_json(&json!({"ran": n, "asked": settled}));
    } else {
        outln!("ran {n} outbox row(s)");
        if settled > 0 {
            outln!("asked the downstream about {settled} unknown outcome(s) (downstream.auto_query)");
        }
    }
    Ok(0)
}

pub(super) fn catalog(what: &CatalogCommand) -> Result<i32, CliError> {
    match what {
        CatalogCommand::ImportMcp {
            out,
            url,
            bearer_env,
            prefix,
            key_argument,
            key_retention_ms,
            force,
            json,
            command,
        } => import_mcp(&ImportMcp {
            out,
            url: url.as_deref(),
            bearer_env: bearer_env.as_deref(),
            prefix,
            key_argument: key_argument.as_deref(),
            key_retention_ms: *key_retention_ms,
            force: *force,
            json: *json,
            command,
        }),
        CatalogCommand::Schema => {
            print_json(&crate::tools::catalog_schema());
            Ok(0)
        }
        CatalogCommand::Check { dir, json } => {
            if !dir.is_dir() {
                return Err(CliError::new(
                    "CATALOG_UNREADABLE",
                    "the catalog directory does not exist or is not a directory",
                ));
            }
            let problems = match crate::tools::load_toolset(Some(dir)) {
                Ok(t) => {
                    let tools: Vec<&str> = t.catalog().all().iter().map(|c| c.name.as_str()).collect();
                    if *json {
                        print_json(&json!({"ok": true, "tools": tools}));
                    } else {
                        outln!("ok: {} tool(s): {}", tools.len(), tools.join(", "));
                    }
                    return Ok(0);
                }
                Err(ContractError::Unreadable(why)) => return Err(CliError::new("CATALOG_UNREADABLE", why)),
                Err(e) => e.into_problems(),
            };
            let rows: Vec<Value> = problems
                .iter()
                .map(|p| match p {
                    ContractError::Invalid { file, field, reason } => {
                        json!({"file": file, "field": field, "reason": reason})
                    }
                    other => json!({"file": "", "field": "", "reason": other.to_string()}),
                })
                .collect();
            if *json {
                print_json(&json!({"ok": false, "problems": rows}));
            } else {
                for p in &problems {
                    outln!("{}", crate::display::escape(&p.to_string()));
                }
                outln!("{} problem(s)", problems.len());
            }
            Ok(1)
        }
    }
}

struct ImportMcp<'a> {
    out: &'a Path,
    url: Option<&'a str>,
    bearer_env: Option<&'a str>,
    prefix: &'a str,
    key_argument: Option<&'a str>,
    key_retention_ms: u64,
    force: bool,
    json: bool,
    command: &'a [String],
}

/// `catalog import-mcp`: the server's tools as catalog files, then the files
/// loaded as `--catalog` would (what was written is known to load).
fn import_mcp(a: &ImportMcp<'_>) -> Result<i32, CliError> {
    use toolgate_adapters::downstream::mcp;
    let section = match (a.url, a.command.is_empty()) {
        (Some(u), true) => {
            let mut s = json!({"url": u});
            if let Some(v) = a.bearer_env {
                s["bearer_env"] = json!(v);
            }
            s
        }
        (None, false) => json!({"command": a.command}),
        _ => return Err(CliError::new("USAGE", "give the server as a command after -- or as --url URL (one of them)")),
    };
    let tools = mcp::list_tools(&section, 30_000).map_err(|why| CliError::new("MCP_SERVER_UNREACHABLE", why))?;
    if tools.is_empty() {
        return Err(CliError::new("MCP_NO_TOOLS", "the server lists no tools"));
    }
    let opts = mcp::ImportOptions {
        section,
        prefix: a.prefix.to_string(),
        key_argument: a.key_argument.map(str::to_string),
        key_retention_ms: a.key_retention_ms,
    };
    let files: Vec<_> = tools.iter().map(|t| mcp::catalog_file(t, &opts)).collect();
    let mut names = std::collections::BTreeSet::new();
    for (file, _, _) in &files {
        if !names.insert(file) {
            return Err(CliError::new(
                "MCP_NAME_CLASH",
                format!("two of the server's tools are both named {file} here"),
            ));
        }
        if !a.force && a.out.join(file).exists() {
            return Err(CliError::new(
                "CATALOG_FILE_EXISTS",
                format!("{file} exists in the directory (--force replaces it)"),
            ));
        }
    }
    std::fs::create_dir_all(a.out)
        .map_err(|e| CliError::new("CATALOG_UNWRITABLE", format!("the directory cannot be made ({})", e.kind())))?;
    for (file, value, _) in &files {
        let text = serde_json::to_string_pretty(value).unwrap_or_default() + "\n";
        std::fs::write(a.out.join(file), text)
            .map_err(|e| CliError::new("CATALOG_UNWRITABLE", format!("{file} cannot be written ({})", e.kind())))?;
    }
    let problems = match crate::tools::load_toolset(Some(a.out)) {
        Ok(_) => Vec::new(),
        Err(e) => e.into_problems().iter().map(ToString::to_string).collect(),
    };
    if a.json {
        let rows: Vec<Value> = files
            .iter()
            .map(|(file, v, notes)| json!({"file": file, "tool": v["name"], "effect": v["effect"], "notes": notes}))
            .collect();
        print_json(&json!({"ok": problems.is_empty(), "files": rows, "problems": problems}));
    } else {
        for (file, v, notes) in &files {
            outln!("{file:<32} {}", v["effect"].as_str().unwrap_or(""));
            for n in notes {
                outln!("    {}", crate::display::escape(n));
            }
        }
        outln!("wrote {} file(s): review them (the effect class above all) before use", files.len());
        for p in &problems {
            outln!("{}", crate::display::escape(p));
        }
    }
    Ok(i32::from(!problems.is_empty()))
}

pub(super) fn bench(cli: &Cli, quick: bool, json: bool, dir: Option<&Path>, http: bool) -> Result<i32, CliError> {
    // `--db postgres://...` benches on that server (databases made and dropped there).
    let postgres = cli.db.clone().filter(|d| Location::is_postgres(d));
    let opts = crate::bench::BenchOptions { quick, dir: dir.map(Path::to_path_buf), postgres, http };
    let report = crate::bench::run(&opts).map_err(CliError::from)?;
    if json {
        print_json(&report);
    } else {
        out!("{}", crate::bench::table(&report));
    }
    Ok(0)
}

pub(super) fn audit(cli: &Cli, log: bool, json: bool) -> Result<i32, CliError> {
    let mut engine = open_read(cli)?;
    if log {
        let rows = engine.audit_log(10_000)?;
        if json {
            print_json(&json!({"log": rows}));
        } else {
            for r in &rows {
                outln!(
                    "{} #{:<5} {:<8} {:<10} {:<8} {:<28} {}",
                    rfc3339(r.at),
                    r.seq,
                    r.result,
                    crate::display::escape(&r.action),
                    crate::display::escape(&r.actor),
                    crate::display::escape(r.operation_id.as_deref().or(r.approval_id.as_deref()).unwrap_or("-")),
                    crate::display::escape(&r.reason)
                );
            }
        }
        return Ok(0);
    }
    let findings = engine.audit()?;
    let warnings = engine.audit_warnings()?;
    // A read opens no downstream it cannot: those were not asked.
    let not_checked = engine.unopened_downstreams().clone();
    if json {
        print_json(&json!({
            "ok": findings.is_empty(), "findings": findings, "warnings": warnings,
            "downstreams_not_checked": not_checked,
        }));
    } else {
        for f in &findings {
            outln!("{:<22} {:<30} {}", f.check, f.reference, f.detail);
        }
        for f in &warnings {
            outln!("warning: {:<13} {:<30} {}", f.check, f.reference, f.detail);
        }
        for (name, why) in &not_checked {
            outln!(
                "not checked: downstream {} (not opened by this read: {})",
                crate::display::escape(name),
                crate::display::escape(why)
            );
        }
        if findings.is_empty() {
            outln!("audit: no findings");
        } else {
            outln!("audit: {} finding(s)", findings.len());
        }
    }
    Ok(i32::from(!findings.is_empty()))
}

pub(super) fn ops(cli: &Cli, what: &OpsCommand) -> Result<i32, CliError> {
    match what {
        OpsCommand::List { state, tool, sort, asc, limit, json } => {
            let mut engine = open_read(cli)?;
            let state = match state.as_deref() {
                None => None,
                Some(s) => Some(crate::store::OpState::parse(s).ok_or_else(|| {
                    let all: Vec<&str> = crate::store::OpState::ALL.iter().map(|s| s.as_str()).collect();
                    CliError::new("BAD_STATE", format!("unknown state {s:?} (one of: {})", all.join(", ")))
                })?),
            };
            let limit = (*limit).clamp(1, 10_000);
            let rows = if tool.is_none() && sort.is_none() {
                engine.list_operations(state, limit)?
            } else {
                // The console's filter and sort, one page of them.
                let column = match sort.as_deref() {
                    None => 0,
                    Some(name) => crate::store::OPS_SORT.iter().position(|c| c.name == name).ok_or_else(|| {
                        let all: Vec<&str> = crate::store::OPS_SORT.iter().map(|c| c.name).collect();
                        CliError::new("BAD_SORT", format!("unknown column {name:?} (one of: {})", all.join(", ")))
                    })?,
                };
                let filter = crate::store::Filter {
                    tool: tool.clone(),
                    states: state.map(|s| vec![s.as_str().to_string()]).unwrap_or_default(),
                    ..crate::store::Filter::default()
                };
                let order = crate::store::Order { column, desc: !*asc };
                engine.ops_page(crate::store::OpsView::All, &filter, order, None, limit)?
            };
            if *json {
                print_json(&json!({"operations": rows}));
            } else {
                outln!(
                    "{:<28} {:<16} {:<13} {:<8} {:<10} {:<24}",
                    "operation",
                    "tool",
                    "state",
                    "version",
                    "key",
                    "updated"
                );
                for o in &rows {
                    outln!(
                        "{:<28} {:<16} {:<13} {:<8} {:<10} {:<24}",
                        o.id,
                        o.tool,
                        o.state,
                        o.version,
                        crate::display::digest(&o.key_sha256, 8),
                        rfc3339(o.updated_at)
                    );
                }
            }
            Ok(0)
        }
        OpsCommand::Show { operation_id, json } => {
            let mut engine = open_read(cli)?;
            let Some(d) = engine.operation_detail(operation_id)? else {
                return Err(CliError::new("NO_SUCH_OPERATION", "no such operation"));
            };
            if *json {
                let trace: Vec<Value> = d.trace.iter().map(trace_json).collect();
                print_json(&json!({
                    "operation": d.operation, "outbox": d.outbox, "attempts": d.attempts, "trace": trace,
                    "audit": d.audit, "may_land_until": d.may_land_until, "receipt_window_until": d.receipt_window_until,
                    "context": d.context.iter().map(|(k, v)| json!({"label": k, "value": v})).collect::<Vec<_>>(),
                }));
            } else {
                print_detail(&d);
            }
            Ok(0)
        }
    }
}

pub(super) fn provider(cli: &Cli, what: &ProviderCommand) -> Result<i32, CliError> {
    let ProviderCommand::Serve { listen, provider_db, public, faults, require_bearer } = what;
    let faults = match faults {
        Some(spec) => {
            crate::downstream::FaultPlan::parse(spec).map_err(|e| CliError::new("BAD_FAULT", e.to_string()))?
        }
        None => crate::downstream::FaultPlan::none(),
    };
    let provider_db = provider_serve_db(cli.db.as_deref(), provider_db.as_deref())?;
    crate::telemetry::logging::init_for_db(provider_db);
    let opts = crate::downstream::serve::ServeOptions {
        listen: *listen,
        public: *public,
        faults,
        require_bearer: require_bearer.clone(),
    };
    crate::downstream::serve::serve(provider_db, opts, |addr| {
        outln!("listening on {addr}");
    })
    .map_err(CliError::from)?;
    Ok(0)
}
