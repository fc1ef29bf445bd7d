//! Commands that run something: `scenario`, `serve`, `cancel`, `load`, `lab`.

use super::{
    clock_from, db_path, engine_options, open, open_read, operator_of, operator_or_user, print_json, print_outcome,
    write_stdout, CancelArgs, Cli, CliError, LabArgs, LoadArgs, ScenarioCommand, ServeArgs,
};
use serde_json::{json, Value};

/// `toolgate scenario list|run`: each scenario runs on its own fresh database; a
/// crash step really aborts a child `toolgate` process (this binary).
pub(super) fn scenario_command(what: &ScenarioCommand) -> Result<i32, CliError> {
    use crate::scenarios::{self, report, CrashMode, RunOptions, ScenarioRun};
    match what {
        ScenarioCommand::List { json } => {
            let all = scenarios::builtin()?;
            if *json {
                let list: Vec<Value> = all
                    .iter()
                    .map(|s| json!({"id": s.id, "slug": s.slug, "title": s.title, "summary": s.summary, "steps": s.steps.len()}))
                    .collect();
                print_json(&json!({"scenarios": list}));
            } else {
                out!("{}", report::list(&all));
            }
            Ok(0)
        }
        ScenarioCommand::Run { target, file, keep_db, json } => {
            let scripts = match (file, target) {
                (Some(f), _) => vec![scenarios::load_file(f)?],
                (None, Some(t)) => scenarios::select(t)?,
                (None, None) => return Err(CliError::new("USAGE", "give a scenario number, `all`, or --file FILE")),
            };
            let bin = std::env::current_exe().map_err(|e| {
                CliError::new("NO_EXECUTABLE", format!("cannot locate the toolgate binary: {}", e.kind()))
            })?;
            if let Some(dir) = keep_db.as_ref().filter(|_| scripts.len() > 1) {
                if dir.exists() {
                    return Err(CliError::new("SCENARIO_DB", "the --keep-db path already exists; choose a new one"));
                }
                std::fs::create_dir_all(dir).map_err(|e| {
                    CliError::new("SCENARIO_DB", format!("cannot create the --keep-db directory: {}", e.kind()))
                })?;
            }
            let (mut passed, mut failed, mut reports) = (0, 0, Vec::new());
            for (i, s) in scripts.iter().enumerate() {
                let keep = keep_db.as_ref().map(|p| {
                    if scripts.len() > 1 {
                        p.join(format!("scenario-{:02}.db", s.id))
                    } else {
                        p.clone()
                    }
                });
                let r = ScenarioRun::run(
                    s,
                    RunOptions { crash_mode: CrashMode::ChildProcess(bin.clone()), keep_db: keep, http: None },
                )?;
                if r.passed {
                    passed += 1;
                } else {
                    failed += 1;
                }
                if *json {
                    reports.push(r);
                } else {
                    if i > 0 {
                        outln!();
                    }
                    out!("{}", report::render(&r));
                }
            }
            if *json {
                print_json(&json!({"scenarios": reports, "passed": passed, "failed": failed}));
            } else {
                outln!();
                outln!("{}", report::summary_line(passed, failed));
            }
            Ok(i32::from(failed > 0))
        }
    }
}

pub(super) fn serve_command(cli: &Cli, a: &ServeArgs) -> Result<i32, CliError> {
    if a.threads == 0 || a.threads > 64 {
        return Err(CliError::new("USAGE", "--threads must be between 1 and 64"));
    }
    let path = db_path(cli)?;
    let opts = engine_options(cli)?;
    crate::telemetry::logging::init_for_db(path);
    let serve = crate::api::ServeOptions {
        listen: a.listen,
        public: a.public,
        threads: a.threads,
        toolset: opts.toolset,
        sync: opts.sync,
        worker: true,
        clock: opts.clock,
        max_connections: a.max_connections as usize,
        max_connections_per_client: a.max_connections_per_client as usize,
    };
    crate::api::serve(path, &serve, |addr| {
        outln!("listening on http://{addr}");
    })
    .map_err(CliError::from)?;
    Ok(0)
}

pub(super) fn cancel_command(cli: &Cli, a: &CancelArgs) -> Result<i32, CliError> {
    let operator = operator_of(cli, "cancel")?;
    let mut engine = open(cli)?;
    let out = engine.cancel(&crate::engine::CancelRequest {
        operation_id: a.operation_id.clone(),
        operator,
        note: a.act.note.clone(),
        seen_version: a.act.seen_version,
        action_id: a.act.action_id.clone(),
    })?;
    print_outcome(&out, a.act.json);
    Ok(i32::from(!out.applied))
}

/// `5%`, `0.05` or `0` → basis points.
pub(super) fn parse_fault_rate(spec: &str) -> Result<u32, CliError> {
    let bad = || CliError::new("BAD_FAULT_RATE", "--fault-rate must be a rate such as 5% or 0.05 (0% to 100%)");
    let s = spec.trim();
    let rate = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map_err(|_| bad())? / 100.0,
        None => s.parse::<f64>().map_err(|_| bad())?,
    };
    if !(0.0..=1.0).contains(&rate) {
        return Err(bad());
    }
    Ok((rate * 10_000.0).round() as u32)
}

pub(super) fn lab_toggle_arg(name: &str) -> Result<crate::engine::LabToggle, CliError> {
    crate::engine::LabToggle::parse(name).ok_or_else(|| {
        let names: Vec<&str> = crate::engine::LabToggle::ALL.iter().map(|t| t.as_str()).collect();
        CliError::new("UNKNOWN_TOGGLE", format!("no lab toggle named {name:?}; one of: {}", names.join(", ")))
    })
}

pub(super) fn load_command(cli: &Cli, a: &LoadArgs) -> Result<i32, CliError> {
    use std::io::IsTerminal;
    let path = db_path(cli)?;
    let fault_bp = a.fault_rate.as_deref().map(parse_fault_rate).transpose()?;
    let lab = a.lab.as_deref().map(lab_toggle_arg).transpose()?;
    if a.agents == 0 || a.agents > 256 {
        return Err(CliError::new("USAGE", "--agents must be between 1 and 256"));
    }
    if let Some(bad) = a.urls.iter().find(|u| !(u.starts_with("http://") || u.starts_with("https://"))) {
        return Err(CliError::new("USAGE", format!("--url takes an http:// address, not {bad:?}")));
    }
    // Opening checks the file (and fails with its own code) before any thread starts.
    drop(open(cli)?);
    let opts = crate::load::LoadOptions {
        agents: a.agents,
        ops: a.ops,
        fault_bp,
        seed: a.seed,
        lab,
        operator: cli.operator.clone().unwrap_or_else(|| "loadgen".into()),
        clock: clock_from(cli.now.as_deref())?,
        toolset: engine_options(cli)?.toolset,
        provider_db: a.provider_db.clone(),
        urls: a.urls.clone(),
        settle_ms: a.settle_ms,
        ..crate::load::LoadOptions::default()
    };
    let bar = std::io::stderr().is_terminal();
    let mut progress = |p: crate::load::Progress| {
        if bar {
            eprint!("\r{}", crate::load::progress_line(&p));
        }
    };
    let report = crate::load::run(path, &opts, &mut progress)?;
    if bar {
        eprintln!();
    }
    if a.json {
        print_json(&report);
    } else {
        write_stdout(&crate::load::render(&report));
    }
    // A run whose every call was refused for what it asked (an unknown tool,
    // a missing grant, arguments the catalog refuses) measured nothing.
    let refused_as_asked = ["UNKNOWN_TOOL", "POLICY_DENIED", "SUBJECT_DISABLED", "INVALID_ARGUMENTS", "NOT_FOUND"];
    if report.calls > 0 && report.answers.keys().all(|code| refused_as_asked.contains(&code.as_str())) {
        let said: Vec<String> = report.answers.iter().map(|(c, n)| format!("{c} {n}")).collect();
        eprintln!(
            "load: every call was refused for what it asked ({}): the catalog or the world does not fit this load",
            said.join(", ")
        );
        return Ok(1);
    }
    // With every defense on, a duplicate or a silently wrong result is a failure.
    Ok(i32::from(lab.is_none() && (report.duplicates > 0 || report.silently_wrong > 0)))
}

pub(super) fn lab_command(cli: &Cli, a: &LabArgs) -> Result<i32, CliError> {
    use std::fmt::Write as _;

    use crate::engine::LabToggle;
    let toggles = a.off || a.toggle.is_some();
    // Only a toggle writes (Command::writes); showing the lab reads.
    let mut engine = if toggles { open(cli)? } else { open_read(cli)? };
    if toggles {
        let toggle = a.toggle.as_deref().map(lab_toggle_arg).transpose()?;
        let operator = operator_or_user(cli);
        engine.set_lab_toggle(toggle, &operator)?;
    }
    let state = engine.lab_state()?;
    if a.json {
        let toggles: Vec<Value> = LabToggle::ALL
            .iter()
            .map(
                |t| json!({"name": t.as_str(), "side": t.side(), "rule": t.rule(), "harm": t.harm(), "keel": t.keel()}),
            )
            .collect();
        print_json(&json!({"lab": state, "toggles": toggles}));
        return Ok(0);
    }
    let mut out = String::new();
    if state.demo {
        let _ = match state.toggle {
            Some(t) => writeln!(out, "LAB: defense OFF: {}  ({})", t.as_str(), t.keel()),
            None => writeln!(out, "lab: every defense on"),
        };
    } else {
        let _ = writeln!(out, "not a demo database: lab toggles are refused here (LAB_NOT_DEMO)");
        let _ = writeln!(out, "make one with `toolgate demo-db --out PATH`, or run `toolgate demo`");
    }
    let _ = writeln!(out, "fault rate of the simulated agents: {:.1}%", f64::from(state.fault_bp) / 100.0);
    let _ = writeln!(out, "masked conflicts so far: {}\n", state.masked_conflicts);
    for t in LabToggle::ALL {
        let on = if state.toggle == Some(t) { "*" } else { " " };
        let _ = writeln!(out, "{on} {:<28} {}", t.as_str(), t.rule());
        let _ = writeln!(out, "  {:<28} {}", "", t.harm());
    }
    write_stdout(&out);
    Ok(0)
}

#[cfg(test)]
mod lab_cli_tests {
    use super::parse_fault_rate;

    #[test]
    fn fault_rates() {
        for (spec, bp) in
            [("5%", Some(500)), ("0.05", Some(500)), ("0", Some(0)), ("100%", Some(10_000)), ("0.5%", Some(50))]
        {
            assert_eq!(parse_fault_rate(spec).ok(), bp, "{spec}");
        }
        for spec in ["-1%", "101%", "x", "1.5"] {
            assert!(parse_fault_rate(spec).is_err(), "{spec}");
        }
    }
}
