//! The walkthrough pane's engine side: steps one of the built-in scenarios
//! (`crate::scenarios`) in its own scratch database. In the console, a crash step
//! is simulated in process (the console cannot abort itself); the pane says so.

use std::path::PathBuf;

use super::app::{EngineEvent, WalkStep, WalkthroughView};
use crate::scenarios::runner::{CrashMode, RunOptions, ScenarioRun, StepObservation};
use crate::scenarios::script::Script;

/// The walkthrough state held by the engine thread.
pub struct Walkthrough {
    scripts: Vec<Script>,
    selected: usize,
    run: Option<ScenarioRun>,
    error: Option<String>,
    scratch: PathBuf,
}

fn walk_step(o: &StepObservation) -> WalkStep {
    WalkStep {
        n: o.step,
        action: o.label.clone(),
        transition: o.transition.to_string(),
        retryable: o.retryable.map_or_else(|| "-".into(), |r| if r { "yes".into() } else { "no".into() }),
        user_sees: o.sees.clone(),
        effects: o.effects,
        verdict: if o.passed { "PASS".into() } else { "FAIL".into() },
    }
}

impl Walkthrough {
    /// Loads the built-in scenarios; nothing runs until the first step.
    pub fn new(scratch: PathBuf, _exe: Option<PathBuf>) -> Self {
        let (scripts, error) = match crate::scenarios::builtin() {
            Ok(s) => (s, None),
            Err(e) => (Vec::new(), Some(e.to_string())),
        };
        Self { scripts, selected: 0, run: None, error, scratch }
    }

    /// Chooses a scenario (and drops any run in progress).
    pub fn select(&mut self, i: usize) {
        if i < self.scripts.len() {
            self.selected = i;
            self.run = None;
        }
    }

    /// Runs the next step (starting the scenario on a fresh database if needed).
    pub fn step(&mut self) {
        if self.run.as_ref().is_some_and(ScenarioRun::is_finished) {
            self.run = None;
        }
        if self.run.is_none() {
            let Some(script) = self.scripts.get(self.selected) else { return };
            let dir = self.scratch.join(format!("walk-{}-{}", script.id, hex::encode(rand::random::<[u8; 4]>())));
            if let Err(e) = std::fs::create_dir_all(&dir) {
                self.error = Some(format!("cannot create a scratch directory: {}", e.kind()));
                return;
            }
            match ScenarioRun::new(
                script,
                RunOptions { crash_mode: CrashMode::InProcess, keep_db: Some(dir.join("walkthrough.db")), http: None },
            ) {
                Ok(r) => {
                    self.run = Some(r);
                    self.error = None;
                }
                Err(e) => {
                    self.error = Some(e.to_string());
                    return;
                }
            }
        }
        if let Some(r) = self.run.as_mut() {
            r.step();
        }
    }

    /// The database the current run writes (the other panes can show it).
    pub fn db_path(&self) -> Option<PathBuf> {
        self.run.as_ref().map(|r| r.db_path().to_path_buf())
    }

    /// What the pane shows now.
    pub fn view(&self) -> EngineEvent {
        let steps: Vec<WalkStep> =
            self.run.as_ref().map(|r| r.observations().iter().map(walk_step).collect()).unwrap_or_default();
        let more = self.run.as_ref().is_none_or(|r| !r.is_finished());
        let crash_note = self.error.clone().unwrap_or_else(|| {
            "crash steps are simulated in process here (the console cannot abort itself); `toolgate scenario run` uses a real child-process abort".to_string()
        });
        EngineEvent::Walkthrough(WalkthroughView {
            scenarios: self.scripts.iter().map(|s| (s.id.to_string(), s.title.clone())).collect(),
            selected: self.selected,
            steps,
            more,
            crash_note,
            db_label: self.run.as_ref().map(|r| format!("scenario {} scratch db", r.script().id)),
            clock_ms: self.run.as_ref().map(ScenarioRun::now_ms),
        })
    }
}
