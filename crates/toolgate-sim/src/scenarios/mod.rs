//! The `create_refund` scenarios of docs/design.md §13 (and a few more), as data that the
//! tests, `toolgate scenario` and the console all run.
//!
//! - [`script`]: the file format of `assets/scenarios/*.json` and its strict loader.
//! - [`runner`]: [`ScenarioRun`], a stepper that runs a script against a fresh
//!   database with a manual clock and yields one [`StepObservation`] per step.
//! - [`report`]: the learner's table printed by `toolgate scenario run`.
//!
//! The scenarios are embedded in the binary ([`builtin`]), so they run from any
//! directory.

mod gate;
pub mod report;
pub mod runner;
pub mod script;

pub use runner::{
    CrashKind, CrashMode, CrashReport, HttpProviders, Mismatch, RunOptions, ScenarioReport, ScenarioRun,
    StepObservation,
};
pub use script::{Action, Expectation, Script, Step, Transition};

use crate::engine::EngineError;
use crate::store::StoreError;

/// The scenario files shipped in `assets/scenarios/`, in order.
pub const BUILTIN: &[(&str, &str)] = &[
    ("01_first_success.json", include_str!("../../../../assets/scenarios/01_first_success.json")),
    ("02_retry_same_key.json", include_str!("../../../../assets/scenarios/02_retry_same_key.json")),
    ("03_same_key_other_amount.json", include_str!("../../../../assets/scenarios/03_same_key_other_amount.json")),
    ("04_crash_after_commit.json", include_str!("../../../../assets/scenarios/04_crash_after_commit.json")),
    ("05_approval_expired.json", include_str!("../../../../assets/scenarios/05_approval_expired.json")),
    ("06_permission_revoked.json", include_str!("../../../../assets/scenarios/06_permission_revoked.json")),
    ("07_rate_limited.json", include_str!("../../../../assets/scenarios/07_rate_limited.json")),
    ("08_timeout_before_execute.json", include_str!("../../../../assets/scenarios/08_timeout_before_execute.json")),
    ("09_concurrent_duplicate.json", include_str!("../../../../assets/scenarios/09_concurrent_duplicate.json")),
    ("10_notify_lost_reply.json", include_str!("../../../../assets/scenarios/10_notify_lost_reply.json")),
    ("11_late_reply_after_lease.json", include_str!("../../../../assets/scenarios/11_late_reply_after_lease.json")),
    ("12_last_ten_euros.json", include_str!("../../../../assets/scenarios/12_last_ten_euros.json")),
];

/// Why a scenario could not be loaded or started. A step that fails its
/// expectation is not an error: it is a [`StepObservation`] with failures.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The script is invalid: `at` names the step and field.
    #[error("{file}: {at}: {message}")]
    Script {
        /// File name.
        file: String,
        /// Step and field, e.g. `step 3 (query).status_ref_from`.
        at: String,
        /// What is wrong.
        message: String,
    },
    /// No scenario has that number.
    #[error("no scenario {0:?} (see `toolgate scenario list`)")]
    NoSuchScenario(String),
    /// The scenario database could not be set up.
    #[error("scenario database: {0}")]
    Db(String),
    /// The engine failed while setting up.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Storage failed while setting up.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl toolgate_core::Coded for ScenarioError {
    /// Stable code for the CLI.
    fn code(&self) -> &'static str {
        match self {
            ScenarioError::Script { .. } => "SCENARIO_INVALID",
            ScenarioError::NoSuchScenario(_) => "NO_SUCH_SCENARIO",
            ScenarioError::Db(_) => "SCENARIO_DB",
            ScenarioError::Engine(e) => e.code(),
            ScenarioError::Store(e) => e.code(),
        }
    }
}

/// Loads a scenario file from disk (the file's name, not its path, appears in errors).
pub fn load_file(path: &std::path::Path) -> Result<Script, ScenarioError> {
    let name = path.file_name().map_or_else(|| "scenario".to_string(), |n| n.to_string_lossy().into_owned());
    let text = std::fs::read(path).map_err(|e| ScenarioError::Script {
        file: name.clone(),
        at: "file".into(),
        message: format!("cannot read it: {}", e.kind()),
    })?;
    script::parse(&name, &text)
}

/// Every built-in scenario, loaded and checked, in order.
pub fn builtin() -> Result<Vec<Script>, ScenarioError> {
    BUILTIN.iter().map(|(name, text)| script::parse(name, text.as_bytes())).collect()
}

/// The built-in scenarios a CLI target names: a number or `all`.
pub fn select(target: &str) -> Result<Vec<Script>, ScenarioError> {
    let all = builtin()?;
    if target == "all" {
        return Ok(all);
    }
    let id: u32 = target.parse().map_err(|_| ScenarioError::NoSuchScenario(target.to_string()))?;
    let picked: Vec<Script> = all.into_iter().filter(|s| s.id == id).collect();
    if picked.is_empty() {
        return Err(ScenarioError::NoSuchScenario(target.to_string()));
    }
    Ok(picked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_scenarios_load_with_unique_ordered_ids() {
        let all = builtin().unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<u32> = all.iter().map(|s| s.id).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(ids, sorted, "ids unique and in file order");
        assert!(ids.starts_with(&[1, 2, 3, 4, 5, 6, 7]), "the seven of docs/design.md §13 come first");
    }
}
