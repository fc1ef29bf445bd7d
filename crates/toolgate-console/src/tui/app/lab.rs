//! The console's resilience and lab controls (view state only, like the rest of
//! `app`): cancel an operation (`c`: note form, then a confirm dialog with the
//! evidence, Cancel focused), cycle the simulated agents' fault rate (`f`), and
//! the lab panel (`L`) that switches one defense off on a demo database and
//! explains which rule that breaks. Every change is a [`Request`] for the engine
//! thread; the engine refuses lab toggles on a database not marked as a demo.

use super::{Action, App, Confirm, Form, FormKind, Mode, Request, Rows};
use crate::engine::LabToggle;
use crate::store::OpState;

/// The fault rates `f` cycles through, in basis points (the last is an outage:
/// every call faults, and the circuit breaker opens).
pub const FAULT_STEPS: [u32; 5] = [0, 100, 500, 2_000, 10_000];

/// Whether the lab panel took an action.
pub(super) enum Intercept {
    /// Not a lab-panel action: the normal handling applies.
    NotMine,
    /// Handled, with this request for the engine (if any).
    Handled(Option<Request>),
}

/// What the simulated agents in this process have seen (the console demo).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentsView {
    /// Intents finished.
    pub intents: u64,
    /// Calls made.
    pub calls: u64,
    /// Conflicting re-sends answered `succeeded`.
    pub masked_conflicts: u64,
    /// Replays that got another result.
    pub replay_mismatches: u64,
    /// Intents believed failed whose effect exists.
    pub wrong_beliefs: u64,
    /// Dispatcher restarts.
    pub restarts: u64,
}

/// The lab panel's contents and the header's lab badge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabView {
    /// The database is marked as a demo (toggles allowed).
    pub demo: bool,
    /// The defense switched off, if any.
    pub toggle: Option<LabToggle>,
    /// The simulated agents' fault rate, basis points.
    pub fault_bp: u32,
    /// Conflicts the engine answered with the old result (all time).
    pub masked_conflicts: i64,
    /// Agents running in this process, if any.
    pub agents: Option<AgentsView>,
}

/// `12.5%` from basis points.
pub fn percent(bp: u32) -> String {
    let p = f64::from(bp) / 100.0;
    if bp.is_multiple_of(100) {
        format!("{p:.0}%")
    } else {
        format!("{p:.1}%")
    }
}

impl App {
    /// Lab mode swallows the navigation keys it uses.
    pub(super) fn lab_intercept(&mut self, action: &Action) -> Intercept {
        if self.mode != Mode::Lab {
            return Intercept::NotMine;
        }
        let n = LabToggle::ALL.len();
        Intercept::Handled(match action {
            Action::Up | Action::Scroll(-1) => {
                self.lab_selected = (self.lab_selected + n - 1) % n;
                None
            }
            Action::Down | Action::Scroll(1) => {
                self.lab_selected = (self.lab_selected + 1) % n;
                None
            }
            Action::Submit => self.ask_lab_toggle(),
            Action::Back | Action::OpenLab => {
                self.mode = Mode::Normal;
                None
            }
            _ => return Intercept::NotMine,
        })
    }

    /// `L`: opens the lab panel (read-only consoles see it, but cannot switch).
    pub(super) fn open_lab(&mut self) -> Option<Request> {
        self.mode = Mode::Lab;
        if let Some(i) = self.lab.toggle.and_then(|t| LabToggle::ALL.iter().position(|x| *x == t)) {
            self.lab_selected = i;
        }
        None
    }

    fn ask_lab_toggle(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        if !self.lab.demo {
            self.say("LAB_NOT_DEMO: lab toggles are refused on a database not marked as a demo", true);
            return None;
        }
        let t = LabToggle::ALL[self.lab_selected.min(LabToggle::ALL.len() - 1)];
        if self.lab.toggle == Some(t) {
            self.say(format!("{} is already off; `o` puts every defense back", t.as_str()), false);
            return None;
        }
        let evidence = vec![
            format!("switch OFF  {}", t.as_str()),
            format!("breaks      {}", t.rule()),
            format!("source text {}", t.keel()),
            format!("now         {}", self.lab.toggle.map_or("every defense on", LabToggle::as_str)),
            "every engine and agent on this demo database picks it up at its next call".to_string(),
        ];
        self.dialog.confirm = Some(Confirm {
            title: "Lab: switch a defense off".into(),
            evidence,
            request: Request::SetLab(Some(t)),
            on_confirm: false,
        });
        self.mode = Mode::Confirm;
        None
    }

    /// `o` in the lab panel: every defense back on.
    pub(super) fn lab_all_on(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        if self.lab.toggle.is_none() {
            self.say("every defense is already on", false);
            return None;
        }
        Some(Request::SetLab(None))
    }

    /// `f`: the next fault rate for the simulated agents.
    pub(super) fn cycle_faults(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let next = FAULT_STEPS.iter().position(|s| *s == self.lab.fault_bp).map_or(0, |i| (i + 1) % FAULT_STEPS.len());
        // From the step last asked for, not the last one the engine reported:
        // `ffff` typed at once goes four steps (each `f` had asked for 1%).
        self.lab.fault_bp = FAULT_STEPS[next];
        Some(Request::SetFaultRate(FAULT_STEPS[next]))
    }

    /// `c`: cancel the selected accepted or in-flight operation (note first).
    pub(super) fn ask_cancel(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let picked = match &self.rows {
            _ if self.mode == Mode::Detail => self.detail.op.as_ref().map(|d| {
                let o = &d.operation;
                let attempts = d
                    .outbox
                    .as_ref()
                    .map(|ob| format!("{} (last: {})", ob.attempt, ob.last_code.clone().unwrap_or_else(|| "-".into())));
                (o.id.clone(), o.state, Some(o.version), o.tool.clone(), attempts)
            }),
            Rows::Ops(r) => {
                r.get(self.selected).map(|o| (o.id.clone(), o.state, Some(o.version), o.tool.clone(), None))
            }
            Rows::Live(r) => r.get(self.selected).map(|o| {
                let last = o.last_code.clone().unwrap_or_else(|| "-".into());
                (o.operation_id.clone(), o.state, None, o.tool.clone(), Some(format!("{} (last: {last})", o.attempt)))
            }),
            _ => None,
        };
        let Some((operation_id, state, seen_version, tool, attempts)) = picked.filter(|p| p.1.is_in_progress()) else {
            self.say_not_applicable(
                "cancel it (only accepted or in_flight)",
                "select an accepted or in-flight operation (pane 1 or 2) to cancel",
            );
            return None;
        };
        let kind = FormKind::Cancel { operation_id, state, seen_version, tool, attempts };
        self.dialog.form =
            Some(Form { kind, choice: None, evidence: String::new(), note: String::new(), field: 2, error: None });
        self.mode = Mode::Form;
        None
    }

    /// The confirm dialog of a filled-in cancel form: what cancelling will mean.
    pub(super) fn confirm_cancel(f: &Form) -> Option<Confirm> {
        let FormKind::Cancel { operation_id, state, seen_version, tool, attempts } = &f.kind else { return None };
        let mut evidence = vec![
            format!("operation   {operation_id}  ({tool})"),
            format!("state       {state}{}", seen_version.map_or_else(String::new, |v| format!(" (version {v})"))),
        ];
        if let Some(a) = attempts {
            evidence.push(format!("attempts    {a}"));
        }
        evidence.push(if *state == OpState::Accepted {
            "nothing sent yet: it is cancelled (CANCELLED, terminal, no effect)".to_string()
        } else {
            "an attempt may be at the provider: if it was sent, the effect cannot be undone and it moves to the unknown queue".to_string()
        });
        evidence.push(format!("note        {}", f.note));
        Some(Confirm {
            title: "Cancel operation".into(),
            evidence,
            request: Request::Cancel {
                operation_id: operation_id.clone(),
                note: f.note.clone(),
                seen_version: *seen_version,
            },
            on_confirm: false,
        })
    }
}
