//! Marks and bulk actions (model state): `v` marks or unmarks the selected row,
//! `V` asks the engine for every row of the pane that matches its filter (not
//! only the visible page), `Esc` clears them. With marks, `q` `a` `d` `r` `c`
//! act on every marked row the action applies to, after one confirm dialog
//! (the count, the first rows, the rows skipped and why; Cancel focused). The
//! engine thread runs them one by one ([`crate::engine::Engine::bulk`]) and
//! reports progress and a summary; each row gets its own operator-log entry.

use super::{App, Confirm, Form, FormKind, Mode, Pane, Request, Rows};
use crate::engine::{BulkAction, BulkTarget, Resolution};
use crate::store::{ApprovalRow, ApprovalState, LiveRow, OpState, OperationRow};
use crate::tui::format::short;

/// Most rows `V` marks (a filter matching more says so: narrow it).
pub const MAX_MARKS: usize = 1_000;
/// Rows the confirm dialog lists by name (the rest are counted).
const SHOWN: usize = 5;

/// What a marked row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkKind {
    /// An operation (Live, Ledger, Unknown), in the state it was marked in.
    Operation(OpState),
    /// A pending approval.
    Approval(ApprovalState),
}

/// A marked row, as it was when marked (the engine re-checks everything).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// Operation or approval id.
    pub id: String,
    /// Which, and its state when marked.
    pub kind: MarkKind,
    /// Version seen (the Live pane has none).
    pub version: Option<i64>,
    /// Tool.
    pub tool: String,
    /// Tenant.
    pub tenant: String,
    /// Requester.
    pub subject: String,
    /// Approval expiry.
    pub expires_at: Option<i64>,
    /// An approval's amount as money, from its bound, digest-checked request.
    pub money: Option<String>,
}

impl Mark {
    /// From an operations row.
    pub fn of_op(o: &OperationRow) -> Self {
        Self {
            id: o.id.clone(),
            kind: MarkKind::Operation(o.state),
            version: Some(o.version),
            tool: o.tool.clone(),
            tenant: o.tenant.clone(),
            subject: o.subject.clone(),
            expires_at: None,
            money: None,
        }
    }

    /// From a Live row.
    pub fn of_live(o: &LiveRow) -> Self {
        Self {
            id: o.operation_id.clone(),
            kind: MarkKind::Operation(o.state),
            version: None,
            tool: o.tool.clone(),
            tenant: o.tenant.clone(),
            subject: o.subject.clone(),
            expires_at: None,
            money: None,
        }
    }

    /// From a pending approval.
    pub fn of_approval(a: &ApprovalRow) -> Self {
        Self {
            id: a.id.clone(),
            kind: MarkKind::Approval(a.state),
            version: None,
            tool: a.tool.clone(),
            tenant: a.tenant.clone(),
            subject: a.subject.clone(),
            expires_at: Some(a.expires_at),
            money: crate::tui::format::approval_money(a),
        }
    }
}

/// The marks of a page, for `V`.
pub fn marks_of(rows: &Rows) -> Vec<Mark> {
    match rows {
        Rows::Ops(r) => r.iter().map(Mark::of_op).collect(),
        Rows::Live(r) => r.iter().map(Mark::of_live).collect(),
        Rows::Approvals(r) => r.iter().map(Mark::of_approval).collect(),
        Rows::Audit(_) | Rows::Metrics(_) | Rows::Empty => Vec::new(),
    }
}

/// The bulk action a key asks for, before its note is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkKey {
    /// `q`
    Query,
    /// `a`
    Approve,
    /// `d`
    Deny,
    /// `r`
    Resolve,
    /// `c`
    Cancel,
}

impl BulkKey {
    fn verb(self) -> &'static str {
        match self {
            BulkKey::Query => "status query",
            BulkKey::Approve => "approve",
            BulkKey::Deny => "deny",
            BulkKey::Resolve => "resolve",
            BulkKey::Cancel => "cancel",
        }
    }
}

/// The running bulk action, for the gauge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BulkProgress {
    /// What runs (`status query`).
    pub verb: String,
    /// Finished so far.
    pub done: usize,
    /// Targets.
    pub total: usize,
}

/// Marked rows that an action applies to, and the others with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BulkPlan {
    /// What the key asked.
    pub key: BulkKey,
    /// Rows it applies to.
    pub targets: Vec<Mark>,
    /// Rows it skips, with why.
    pub skipped: Vec<(Mark, String)>,
}

impl App {
    /// Whether this id is marked.
    pub fn is_marked(&self, id: &str) -> bool {
        self.marks.iter().any(|m| m.id == id)
    }

    /// `v`: marks or unmarks the selected row, and moves down.
    pub(super) fn toggle_mark(&mut self) -> Option<Request> {
        let mark = match &self.rows {
            Rows::Ops(r) => r.get(self.selected).map(Mark::of_op),
            Rows::Live(r) => r.get(self.selected).map(Mark::of_live),
            Rows::Approvals(r) => r.get(self.selected).map(Mark::of_approval),
            _ => None,
        };
        let Some(mark) = mark else {
            self.say("nothing to mark here: marks are for operations and approvals (panes 1-4)", true);
            return None;
        };
        if let Some(i) = self.marks.iter().position(|m| m.id == mark.id) {
            self.marks.remove(i);
        } else if self.marks.len() >= MAX_MARKS {
            self.say(format!("at most {MAX_MARKS} marks"), true);
            return None;
        } else {
            self.marks.push(mark);
        }
        if self.selected + 1 < self.rows.len() {
            self.selected += 1;
        }
        self.say(self.marks_line(), false);
        None
    }

    /// `V`: every row of this pane that matches its filter (asked of the engine).
    pub(super) fn mark_all(&mut self) -> Option<Request> {
        if !matches!(self.pane, Pane::Live | Pane::Ledger | Pane::Approvals | Pane::Unknown) {
            self.say("nothing to mark here: marks are for operations and approvals (panes 1-4)", true);
            return None;
        }
        self.say("marking every row that matches the filter…", false);
        Some(Request::MarkAll {
            pane: self.pane,
            filter: self.filter.clone(),
            order: self.order(),
            limit: MAX_MARKS as i64 + 1,
        })
    }

    /// The engine's answer to `V`.
    pub(super) fn on_marked(&mut self, pane: Pane, mut rows: Vec<Mark>) {
        let more = rows.len() > MAX_MARKS;
        rows.truncate(MAX_MARKS);
        let n = rows.len();
        for m in rows {
            if self.marks.len() >= MAX_MARKS {
                break;
            }
            if !self.is_marked(&m.id) {
                self.marks.push(m);
            }
        }
        let what = if self.filter.is_empty() {
            format!("every row of {}", pane.title())
        } else {
            format!("{n} rows matching {:?}", short(&self.filter, 40))
        };
        if more {
            self.say(format!("marked the first {MAX_MARKS} of more: narrow the filter"), true);
        } else {
            self.say(format!("marked {what} · {}", self.marks_line()), false);
        }
    }

    /// What marks do (the status line's `[3 marked]` counts them).
    pub fn marks_line(&self) -> String {
        if self.marks.is_empty() {
            "no marks".into()
        } else {
            "q a d r c act on them · Esc clears".into()
        }
    }

    /// Esc with marks: clear them.
    pub(super) fn clear_marks(&mut self) {
        let n = self.marks.len();
        self.marks.clear();
        self.say(format!("{n} marks cleared"), false);
    }

    /// Which marked rows `key` applies to, and why the others are skipped.
    pub fn plan(&self, key: BulkKey) -> BulkPlan {
        let mut plan = BulkPlan { key, targets: Vec::new(), skipped: Vec::new() };
        for m in &self.marks {
            let why = match (key, m.kind) {
                (BulkKey::Approve | BulkKey::Deny, MarkKind::Operation(_)) => {
                    Some("an operation, not an approval".into())
                }
                (BulkKey::Approve | BulkKey::Deny, MarkKind::Approval(_)) => self.may_decide_mark(m).err(),
                (_, MarkKind::Approval(_)) => Some("an approval, not an operation".into()),
                (BulkKey::Query, MarkKind::Operation(s)) => s.is_terminal().then(|| format!("{s}: already settled")),
                (BulkKey::Resolve, MarkKind::Operation(s)) => {
                    (!s.is_unknown_queue()).then(|| format!("{s}: only unknown or needs_review"))
                }
                (BulkKey::Cancel, MarkKind::Operation(s)) => {
                    (!s.is_in_progress()).then(|| format!("{s}: only accepted or in_flight"))
                }
            };
            match why {
                Some(w) => plan.skipped.push((m.clone(), w)),
                None => plan.targets.push(m.clone()),
            }
        }
        plan
    }

    fn may_decide_mark(&self, m: &Mark) -> Result<(), String> {
        if m.expires_at.is_some_and(|e| self.now_ms >= e) {
            return Err("expired".into());
        }
        if !self.header.approvers.get(&m.tenant).is_some_and(|l| l.contains(&self.operator)) {
            return Err(format!("{} may not approve for {}", self.operator, m.tenant));
        }
        if self.operator == m.subject {
            return Err(format!("{} requested it", self.operator));
        }
        Ok(())
    }

    /// `q` `a` `d` `r` `c` with marks: the note form (deny, resolve, cancel) or
    /// straight to the one confirm dialog (query, approve).
    pub(super) fn ask_bulk(&mut self, key: BulkKey) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        if let Some(p) = &self.bulk {
            self.say(format!("a bulk {} is running ({}/{})", p.verb, p.done, p.total), true);
            return None;
        }
        let plan = self.plan(key);
        if plan.targets.is_empty() {
            let why = plan.skipped.first().map(|(_, w)| w.clone()).unwrap_or_default();
            self.say(
                format!(
                    "{}: none of the {} marked rows applies ({why}); Esc clears the marks",
                    key.verb(),
                    plan.skipped.len()
                ),
                true,
            );
            return None;
        }
        match key {
            BulkKey::Query => self.dialog.confirm = Some(bulk_confirm(&plan, BulkAction::Query, &self.operator)),
            BulkKey::Approve => self.dialog.confirm = Some(bulk_confirm(&plan, BulkAction::Approve, &self.operator)),
            BulkKey::Deny | BulkKey::Resolve | BulkKey::Cancel => {
                let resolve = key == BulkKey::Resolve;
                self.dialog.form = Some(Form {
                    kind: FormKind::Bulk { plan },
                    choice: None,
                    evidence: String::new(),
                    note: String::new(),
                    field: if resolve { 0 } else { 2 },
                    error: None,
                });
                self.mode = Mode::Form;
                return None;
            }
        }
        self.mode = Mode::Confirm;
        None
    }

    /// A filled-in bulk form: its confirm dialog, or what is missing.
    pub(super) fn bulk_form_confirm(&self, f: &Form) -> Result<Option<Confirm>, (String, usize)> {
        let FormKind::Bulk { plan } = &f.kind else { return Ok(None) };
        let note = f.note.trim().to_string();
        let action = match plan.key {
            BulkKey::Deny => BulkAction::Deny { note },
            BulkKey::Cancel => BulkAction::Cancel { note },
            BulkKey::Resolve => match f.choice {
                None => return Err(("choose a decision with ←/→ first".into(), 0)),
                Some(0) => {
                    return Err((
                        "succeeded needs each operation's own receipt id: resolve those one at a time".into(),
                        0,
                    ))
                }
                Some(1) => BulkAction::Resolve { resolution: Resolution::Failed, note, no_evidence: false },
                Some(_) => BulkAction::Resolve { resolution: Resolution::Compensated, note, no_evidence: false },
            },
            BulkKey::Query | BulkKey::Approve => return Ok(None),
        };
        Ok(Some(bulk_confirm(plan, action, &self.operator)))
    }

    /// Progress from the engine thread.
    pub(super) fn on_bulk_progress(&mut self, verb: String, done: usize, total: usize) {
        self.bulk = Some(BulkProgress { verb, done, total });
    }

    /// The bulk action finished: the summary, and the rows acted on are unmarked.
    pub(super) fn on_bulk_done(&mut self, verb: &str, summary: &str, acted: &[String], ok: bool) -> Request {
        self.bulk = None;
        self.marks.retain(|m| !acted.contains(&m.id));
        let left = if self.marks.is_empty() { String::new() } else { format!(" ({} still marked)", self.marks.len()) };
        self.say(format!("{verb} {}: {summary}{left}", acted.len()), !ok);
        self.fetch()
    }
}

/// The one confirm dialog of a bulk action.
fn bulk_confirm(plan: &BulkPlan, action: BulkAction, operator: &str) -> Confirm {
    let n = plan.targets.len();
    let what = if action.on_approvals() { "approval" } else { "operation" };
    let plural = if n == 1 { "" } else { "s" };
    let mut evidence = vec![
        format!("{} on {n} marked {what}{plural}, as {operator}", plan.key.verb()),
        "one call and one audit entry each; a refusal does not stop the rest".to_string(),
    ];
    for m in plan.targets.iter().take(SHOWN) {
        // An approval shows what it pays, as the single dialog does.
        let last = match m.kind {
            MarkKind::Approval(_) => m.money.clone().unwrap_or_else(|| "- (no amount)".into()),
            MarkKind::Operation(s) => short(s.as_str(), 12),
        };
        evidence.push(format!("  {:<28} {:<16} {last}", short(&m.id, 28), short(&m.tool, 16)));
    }
    if n > SHOWN {
        evidence.push(format!("  … and {} more", n - SHOWN));
    }
    if !plan.skipped.is_empty() {
        evidence.push(format!("skips {} marked:", plan.skipped.len()));
        for (m, why) in plan.skipped.iter().take(SHOWN) {
            evidence.push(format!("  {:<28} {}", short(&m.id, 28), short(why, 44)));
        }
        if plan.skipped.len() > SHOWN {
            evidence.push(format!("  … and {} more", plan.skipped.len() - SHOWN));
        }
    }
    evidence.push(match &action {
        BulkAction::Query => "asks each provider for a receipt; never executes a tool".to_string(),
        BulkAction::Approve => "each held call runs as soon as it is approved".to_string(),
        BulkAction::Deny { note } | BulkAction::Cancel { note } | BulkAction::Resolve { note, .. } => {
            format!("note (shared)  {note}")
        }
    });
    if let BulkAction::Resolve { resolution, .. } = &action {
        evidence.push(format!("resolve as     {}", resolution.as_str()));
    }
    let targets = plan.targets.iter().map(|m| BulkTarget { id: m.id.clone(), seen_version: m.version }).collect();
    Confirm {
        title: format!("Bulk {}: {n} {what}{plural}", plan.key.verb()),
        evidence,
        request: Request::Bulk { action, targets },
        on_confirm: false,
    }
}
