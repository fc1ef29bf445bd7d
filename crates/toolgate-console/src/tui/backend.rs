//! The engine side of the console: a thread that owns an [`Engine`], answers
//! [`Request`]s, and watches `PRAGMA data_version` to refresh the visible page
//! when any process commits. Plus the worker/reaper thread. The console itself
//! never touches the database.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toolgate_core::Coded;

use tokio::sync::mpsc::UnboundedSender;

use super::app::{filter, marks_of, summarize, Action, AgentsView, EngineEvent, LabView, Pane, Request, Rows};
use super::walkthrough::Walkthrough;
use crate::engine::{CancelRequest, Engine, EngineError, EngineOptions, ResolveRequest};
use crate::store::OpsView;

/// How the console's engine threads are set up.
#[derive(Clone)]
pub struct BackendOptions {
    /// Database.
    pub path: PathBuf,
    /// Operator identity (approver name, resolver).
    pub operator: String,
    /// Run the outbox workers and the reaper in this process.
    pub workers: bool,
    /// Refuse every state-changing request (the console refuses them first).
    pub read_only: bool,
    /// Where the walkthrough's own scratch databases go.
    pub scratch: PathBuf,
    /// The `toolgate` binary, for scenario steps that need a real child process.
    pub exe: Option<PathBuf>,
    /// Live counters of the simulated agents running in this process (`toolgate demo`).
    pub load: Option<Arc<crate::load::LoadStats>>,
    /// The tools the console's engines use (`--catalog`; the demo's by default).
    pub toolset: Arc<crate::engine::tool::Toolset>,
}

/// Handles to the running threads.
pub struct Backend {
    /// Send requests here.
    pub requests: mpsc::Sender<Request>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Backend {
    /// Stops the threads and waits for them.
    pub fn shutdown(self) {
        self.stop.store(true, Ordering::SeqCst);
        drop(self.requests);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

const POLL: Duration = Duration::from_millis(200);
const MAX_STALE: Duration = Duration::from_secs(5);

/// Starts the engine thread (and the worker thread when asked).
pub fn spawn(opts: &BackendOptions, events: UnboundedSender<Action>) -> Result<Backend, EngineError> {
    let (tx, rx) = mpsc::channel::<Request>();
    let stop = Arc::new(AtomicBool::new(false));
    // Open once here so a broken database fails before the terminal is taken over.
    let engine = Engine::open(
        &opts.path,
        EngineOptions {
            worker_id: format!("console-{}", std::process::id()),
            ..EngineOptions::new(opts.toolset.clone())
        },
    )?;
    // The tools whose downstream cannot be asked: a failed decision on one
    // states that no evidence exists either way, and the confirm says so.
    let unaskable =
        engine.contracts().all().iter().filter(|c| !c.downstream.can_look_up()).map(|c| c.name.clone()).collect();
    let _ = events.send(Action::Engine(EngineEvent::Tools { unaskable }));
    let mut threads = Vec::new();
    let o = opts.clone();
    let ev = events.clone();
    threads.push(std::thread::spawn(move || serve(engine, &o, &rx, &ev)));
    if opts.workers {
        let worker = Engine::open(
            &opts.path,
            EngineOptions {
                worker_id: format!("console-worker-{}", std::process::id()),
                ..EngineOptions::new(opts.toolset.clone())
            },
        )?;
        let s = stop.clone();
        threads.push(std::thread::spawn(move || work(worker, &s, &events)));
    }
    Ok(Backend { requests: tx, stop, threads })
}

fn work(mut engine: Engine, stop: &AtomicBool, events: &UnboundedSender<Action>) {
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = engine.reap().and_then(|_| engine.work_background(64)).and_then(|_| engine.settle_unknown(16)) {
            let _ = events.send(Action::Engine(EngineEvent::Error(format!("worker: {e}"))));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

struct View {
    pane: Pane,
    filter: String,
    order: crate::store::Order,
    cursor: Option<crate::store::Cursor>,
    limit: i64,
}

/// A pane's rows: the page `v` names.
fn rows(engine: &mut Engine, v: &View) -> Result<Rows, EngineError> {
    // The console checked the expression; one restored from elsewhere is checked here too.
    let flt = filter::parse_for(&v.filter, v.pane).map_err(|e| EngineError::invalid("BAD_FILTER", e))?;
    let (order, cursor, limit) = (v.order, v.cursor.as_ref(), v.limit);
    Ok(match v.pane {
        Pane::Live => Rows::Live(engine.live_page(&flt, order, cursor, limit)?),
        Pane::Ledger => Rows::Ops(engine.ops_page(OpsView::All, &flt, order, cursor, limit)?),
        Pane::Unknown => Rows::Ops(engine.ops_page(OpsView::Unknown, &flt, order, cursor, limit)?),
        Pane::Approvals => Rows::Approvals(engine.approvals_page(&flt, order, cursor, limit)?),
        Pane::Audit => Rows::Audit(engine.audit_page(&flt, order, cursor, limit)?),
        Pane::Walkthrough | Pane::Metrics => Rows::Empty,
    })
}

/// The page a [`Request::Fetch`] asks for, as the engine thread answers it
/// (`None` for any other request): the render bench times frames through this.
pub fn fetch_page(engine: &mut Engine, request: Request) -> Option<Result<EngineEvent, EngineError>> {
    let Request::Fetch { pane, filter, order, cursor, limit } = request else {
        return None;
    };
    Some(fetch(engine, &View { pane, filter, order, cursor, limit }))
}

fn fetch(engine: &mut Engine, v: &View) -> Result<EngineEvent, EngineError> {
    let rows = match v.pane {
        Pane::Live | Pane::Ledger | Pane::Unknown | Pane::Approvals | Pane::Audit => rows(engine, v)?,
        Pane::Walkthrough => Rows::Empty,
        Pane::Metrics => Rows::Metrics(Box::new(crate::telemetry::metrics::snapshot(
            engine,
            crate::telemetry::metrics::Window::last_minutes(15),
            &crate::telemetry::metrics::Slice::default(),
        )?)),
    };
    Ok(EngineEvent::Page { pane: v.pane, rows, header: engine.header_counts()? })
}

/// For a Ledger page: which of its operations a person acted on (the purge
/// never takes those).
pub fn acted_on(engine: &mut Engine, page: &EngineEvent) -> Option<EngineEvent> {
    let EngineEvent::Page { pane: Pane::Ledger, rows: Rows::Ops(rows), .. } = page else { return None };
    let ids: Vec<String> = rows.iter().filter(|o| o.terminal_at.is_some()).map(|o| o.id.clone()).collect();
    Some(engine.acted_on_by_a_person(&ids).map_or_else(|e| EngineEvent::Error(e.to_string()), EngineEvent::ActedOn))
}

fn serve(mut engine: Engine, opts: &BackendOptions, rx: &mpsc::Receiver<Request>, events: &UnboundedSender<Action>) {
    // `:operator NAME` changes who the actions are recorded as.
    let mut opts = opts.clone();
    let mut view = View {
        pane: Pane::Unknown,
        filter: String::new(),
        order: super::app::default_order(Pane::Unknown),
        cursor: None,
        limit: 20,
    };
    let mut live = true;
    let mut seen_version = -1;
    let mut last_fetch = Instant::now();
    let mut walk = Walkthrough::new(opts.scratch.clone(), opts.exe.clone());
    // While a walkthrough runs, every pane shows the scenario's own database.
    let mut scenario: Option<(PathBuf, Engine)> = None;
    let send = |e: EngineEvent| events.send(Action::Engine(e)).is_ok();
    if !send(walk.view()) {
        return;
    }
    loop {
        let mut refresh = false;
        let received = rx.recv_timeout(POLL);
        let eng: &mut Engine = match scenario.as_mut() {
            Some((_, e)) => e,
            None => &mut engine,
        };
        match received {
            Ok(Request::SetOperator(name)) => opts.operator = name,
            Ok(req) => {
                let walk_step = matches!(req, Request::ScenarioStep | Request::ScenarioSelect(_));
                let (ev, then_refresh) = handle(eng, &opts, &mut view, &mut live, &mut walk, req, &send);
                if let Some(ev) = ev {
                    if !send(ev) {
                        return;
                    }
                }
                refresh = then_refresh;
                if walk_step {
                    let path = walk.db_path();
                    let same = matches!((&path, &scenario), (Some(p), Some((q, _))) if p == q);
                    if !same {
                        scenario = path.and_then(|p| {
                            Engine::open(
                                &p,
                                EngineOptions {
                                    worker_id: "console-walkthrough".into(),
                                    ..crate::tools::demo_options()
                                },
                            )
                            .ok()
                            .map(|e| (p, e))
                        });
                    }
                    refresh = true;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if live {
                    let v = eng.data_version().unwrap_or(-2);
                    refresh = v != seen_version || last_fetch.elapsed() > MAX_STALE;
                    seen_version = v;
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if refresh {
            last_fetch = Instant::now();
            let eng: &mut Engine = match scenario.as_mut() {
                Some((_, e)) => e,
                None => &mut engine,
            };
            let ev = fetch(eng, &view)
                .unwrap_or_else(|e| EngineEvent::RefreshFailed { code: e.code().to_string(), error: e.to_string() });
            // Before the page it is about: its "kept" column reads it.
            if let Some(acted) = acted_on(eng, &ev) {
                if !send(acted) {
                    return;
                }
            }
            if !send(ev) {
                return;
            }
            let lab = lab_view(eng, opts.load.as_deref()).unwrap_or_else(|e| EngineEvent::Error(e.to_string()));
            if !send(lab) {
                return;
            }
        }
    }
}

/// `V`: every row of `pane` matching `filter`, in `order`, at most `limit`.
pub fn mark_all(
    engine: &mut Engine,
    pane: Pane,
    filter: String,
    order: crate::store::Order,
    limit: i64,
) -> EngineEvent {
    let v = View { pane, filter, order, cursor: None, limit };
    match rows(engine, &v) {
        Ok(r) => EngineEvent::Marked { pane, marks: marks_of(&r) },
        Err(e) => EngineEvent::Error(format!("{}: {e}", e.code())),
    }
}

/// A bulk action as `operator`: progress after each target through `send`,
/// the summary as the answer.
pub fn run_bulk(
    engine: &mut Engine,
    operator: &str,
    action: &crate::engine::BulkAction,
    targets: &[crate::engine::BulkTarget],
    send: &dyn Fn(EngineEvent) -> bool,
) -> EngineEvent {
    let verb = action.verb().to_string();
    let total = targets.len();
    match engine.bulk(action, targets, operator, |done, _| {
        send(EngineEvent::BulkProgress { verb: verb.clone(), done, total });
    }) {
        Ok(report) => EngineEvent::BulkDone {
            summary: report.summary(),
            acted: report.items.iter().map(|i| i.id.clone()).collect(),
            ok: report.all_done(),
            verb,
        },
        Err(e) => EngineEvent::BulkDone { verb, summary: format!("{}: {e}", e.code()), acted: Vec::new(), ok: false },
    }
}

/// A resolve as `operator`. A refusal that only a decision against the
/// evidence can pass (the provider's evidence contradicts the decision, or a
/// receipt may still appear) comes back as [`EngineEvent::Contradicted`], for
/// the console's own confirm; any other answer as [`EngineEvent::Done`].
pub fn resolve(engine: &mut Engine, operator: &str, request: Request) -> EngineEvent {
    let Request::Resolve { operation_id, resolution, note, evidence, seen_version, no_evidence, against_evidence } =
        request.clone()
    else {
        return EngineEvent::Error("not a resolve request".into());
    };
    let req = ResolveRequest {
        operation_id: operation_id.clone(),
        resolution,
        operator: operator.to_string(),
        note,
        evidence,
        seen_version: Some(seen_version),
        action_id: None,
        no_evidence,
    };
    let out = if against_evidence { engine.resolve_against_evidence(&req) } else { engine.resolve(&req) };
    match out {
        Ok(o)
            if !o.applied && !against_evidence && matches!(o.code, "STATUS_CONFLICT" | "RECEIPT_MAY_STILL_APPEAR") =>
        {
            EngineEvent::Contradicted { code: o.code.to_string(), why: o.message, request: Box::new(request) }
        }
        Ok(o) if o.applied => {
            let against = if against_evidence { ", against the evidence" } else { "" };
            EngineEvent::Done { ok: true, summary: format!("resolve {operation_id}: {}{against}", o.message) }
        }
        Ok(o) => EngineEvent::Done { ok: false, summary: format!("resolve {operation_id}: {} {}", o.code, o.message) },
        Err(e) => EngineEvent::Done { ok: false, summary: format!("{}: {e}", e.code()) },
    }
}

/// Whether a request changes the ledger (refused in read-only mode).
fn changes_state(req: &Request) -> bool {
    matches!(
        req,
        Request::Query { .. }
            | Request::Approve { .. }
            | Request::Deny { .. }
            | Request::Resolve { .. }
            | Request::Cancel { .. }
            | Request::SetFaultRate(_)
            | Request::SetLab(_)
            | Request::Bulk { .. }
    )
}

/// The lab panel's state: the database's, plus this process's agents.
fn lab_view(engine: &mut Engine, load: Option<&crate::load::LoadStats>) -> Result<EngineEvent, EngineError> {
    use std::sync::atomic::Ordering::Relaxed;
    let s = engine.lab_state()?;
    Ok(EngineEvent::Lab(LabView {
        demo: s.demo,
        toggle: s.toggle,
        fault_bp: s.fault_bp,
        masked_conflicts: s.masked_conflicts,
        agents: load.map(|l| AgentsView {
            intents: l.intents.load(Relaxed),
            calls: l.calls.load(Relaxed),
            masked_conflicts: l.masked_conflicts.load(Relaxed),
            replay_mismatches: l.replay_mismatches.load(Relaxed),
            wrong_beliefs: l.wrong_beliefs.load(Relaxed),
            restarts: l.restarts.load(Relaxed),
        }),
    }))
}

fn handle(
    engine: &mut Engine,
    opts: &BackendOptions,
    view: &mut View,
    live: &mut bool,
    walk: &mut Walkthrough,
    req: Request,
    send: &dyn Fn(EngineEvent) -> bool,
) -> (Option<EngineEvent>, bool) {
    let done = |r: Result<(bool, String), EngineError>| match r {
        Ok((ok, summary)) => EngineEvent::Done { ok, summary },
        Err(e) => EngineEvent::Done { ok: false, summary: format!("{}: {e}", e.code()) },
    };
    if opts.read_only && changes_state(&req) {
        let ev = EngineEvent::Done { ok: false, summary: "READ_ONLY: the console is read-only".into() };
        return (Some(ev), false);
    }
    match req {
        Request::MarkAll { pane, filter, order, limit } => (Some(mark_all(engine, pane, filter, order, limit)), false),
        Request::Bulk { action, targets } => (Some(run_bulk(engine, &opts.operator, &action, &targets, send)), true),
        Request::Fetch { pane, filter, order, cursor, limit } => {
            *view = View { pane, filter, order, cursor, limit };
            (None, true)
        }
        Request::SetLive(on) => {
            *live = on;
            (None, on)
        }
        Request::Cancel { operation_id, note, seen_version } => {
            let r = engine
                .cancel(&CancelRequest {
                    operation_id: operation_id.clone(),
                    operator: opts.operator.clone(),
                    note,
                    seen_version,
                    action_id: None,
                })
                .map(|o| {
                    let code = if o.applied { String::new() } else { format!("{} ", o.code) };
                    (o.applied, format!("cancel {operation_id}: {code}{}", o.message))
                });
            (Some(done(r)), true)
        }
        Request::SetFaultRate(bp) => {
            let r = engine
                .set_load_fault_rate(bp)
                .map(|()| (true, format!("simulated agents' fault rate: {}", crate::tui::app::percent(bp))));
            (Some(done(r)), true)
        }
        Request::SetLab(toggle) => {
            let r = engine.set_lab_toggle(toggle, &opts.operator).map(|()| {
                let what = toggle
                    .map_or_else(|| "every defense back on".to_string(), |t| format!("defense OFF: {}", t.as_str()));
                (true, format!("lab: {what}"))
            });
            (Some(done(r)), true)
        }
        Request::Detail(id) => match engine.operation_detail(&id) {
            Ok(Some(d)) => (Some(EngineEvent::Detail(Box::new(d))), false),
            Ok(None) => (Some(EngineEvent::Error("no such operation".into())), false),
            Err(e) => (Some(EngineEvent::Error(e.to_string())), false),
        },
        Request::FindOperation { prefix, limit } => {
            let ev = match engine.operation_ids_with_prefix(&prefix, limit) {
                Ok(ids) => EngineEvent::Found { asked: prefix.clone(), prefix: Some(prefix), ids },
                Err(e) => EngineEvent::Error(e.to_string()),
            };
            (Some(ev), false)
        }
        Request::FindByKey { key, tenant, limit } => {
            // The key itself is not echoed back: screens show keys only as digests.
            let ev = match engine.operation_ids_with_key(&key, &tenant, limit) {
                Ok(ids) => EngineEvent::Found { asked: format!("that key in {tenant}"), prefix: None, ids },
                Err(e) => EngineEvent::Error(e.to_string()),
            };
            (Some(ev), false)
        }
        Request::Query { operation_id } => {
            let r = engine.operator_query(&operation_id, &opts.operator).map(|env| {
                let (_, s) = summarize(&env);
                (true, format!("query {operation_id}: {s}"))
            });
            (Some(done(r)), true)
        }
        Request::Approve { approval_id } => {
            let r = engine.approve(&approval_id, &opts.operator).map(|env| {
                let (ok, s) = summarize(&env);
                (ok, format!("approve {approval_id}: {s}"))
            });
            (Some(done(r)), true)
        }
        Request::Deny { approval_id, note } => {
            let r = engine
                .deny(&approval_id, &opts.operator, &note)
                .map(|o| (o.applied, format!("deny {approval_id}: {}", o.message)));
            (Some(done(r)), true)
        }
        req @ Request::Resolve { .. } => (Some(resolve(engine, &opts.operator, req)), true),
        // Taken by `serve`, which owns the options.
        Request::SetOperator(_) => (None, false),
        Request::ScenarioSelect(i) => {
            walk.select(i);
            (Some(walk.view()), false)
        }
        Request::ScenarioStep => {
            walk.step();
            (Some(walk.view()), false)
        }
    }
}
