//! The console's state and its update function (The Elm Architecture): an
//! [`Action`] changes view state only; anything that touches the ledger becomes a
//! [`Request`] for the engine thread, whose answers come back as actions.

use crate::engine::envelope::Envelope;
use crate::engine::views::HeaderCounts;
use crate::engine::{OperationDetail, Resolution};
use crate::store::{ApprovalRow, AuditRow, Cursor, LiveRow, OpState, OperationRow, Order};

mod command;
pub mod filter;
mod lab;
mod marks;
mod prefs;
mod sort;
mod why;
pub use command::{parse as parse_command, Command, CommandBar, CommandSpec, COMMANDS, MATCHES_SHOWN};
pub use lab::{percent, AgentsView, LabView, FAULT_STEPS};
pub use marks::{marks_of, BulkKey, BulkPlan, BulkProgress, Mark, MarkKind, MAX_MARKS};
pub use prefs::{PanePrefs, Prefs};
pub use sort::{columns as sort_columns, default_order};
pub use why::{explain, explain_approval, found_receipt, reason, request_terms, FoundReceipt, Why};

/// The pane table: each pane's variant, tab title and whether it shows a
/// keyset-paged table of rows (a switch waits for its first page). The enum,
/// the tab order ([`Pane::ALL`], number keys 1..), the titles and the help
/// line all come from this one list, so a new pane is a row here plus the
/// exhaustive matches the compiler then asks for (fetch, render, filter target).
macro_rules! panes {
    ($( $(#[$meta:meta])* $var:ident => $title:literal, paged: $paged:literal; )*) => {
        /// The panes, in tab order (number keys 1, 2, ...).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Pane {
            $( $(#[$meta])* $var, )*
        }

        impl Pane {
            /// All panes in tab order.
            pub const ALL: [Pane; [$(stringify!($var)),*].len()] = [$(Pane::$var),*];

            /// Tab title.
            pub fn title(self) -> &'static str {
                match self {
                    $( Pane::$var => $title, )*
                }
            }

            /// Whether the pane is a keyset-paged table of rows.
            pub fn paged(self) -> bool {
                match self {
                    $( Pane::$var => $paged, )*
                }
            }
        }
    };
}

panes! {
    /// In-flight and waiting attempts.
    Live => "Live", paged: true;
    /// The idempotency ledger.
    Ledger => "Ledger", paged: true;
    /// Pending approvals.
    Approvals => "Approvals", paged: true;
    /// Outcome-unknown queue (with needs-review).
    Unknown => "Unknown", paged: true;
    /// Operator log.
    Audit => "Audit", paged: true;
    /// Scenario walkthrough.
    Walkthrough => "Walkthrough", paged: false;
    /// Rates, latency percentiles, oldest unknown, duplicates.
    Metrics => "Metrics", paged: false;
}

impl Pane {
    fn index(self) -> usize {
        Pane::ALL.iter().position(|p| *p == self).unwrap_or(0)
    }

    /// The pane a number key selects (`1` is the first), if any.
    pub fn of_key(c: char) -> Option<Pane> {
        let n = c.to_digit(10)? as usize;
        n.checked_sub(1).and_then(|i| Pane::ALL.get(i).copied())
    }
}

/// The dialogs' own state: at most one form and one confirm are open, and
/// both return to the mode they were opened from.
#[derive(Debug, Clone, Default)]
pub struct DialogView {
    /// Confirm dialog.
    pub confirm: Option<Confirm>,
    /// Open form.
    pub form: Option<Form>,
    /// Mode to return to when a confirm dialog or form closes (the detail view
    /// when it was opened there).
    pub return_to: Mode,
}

/// The detail view's own state (`Mode::Detail`).
#[derive(Debug, Clone, Default)]
pub struct DetailView {
    /// The operation shown.
    pub op: Option<Box<OperationDetail>>,
    /// A pending approval shown instead (no operation exists before it is
    /// approved) while set.
    pub approval: Option<Box<ApprovalRow>>,
    /// Lines scrolled.
    pub scroll: u16,
    /// `F`: the detail is fetched again whenever the ledger changes, and shown
    /// scrolled to its end (the newest trace events).
    pub follow: bool,
}

impl DetailView {
    /// Opens on an operation still to be fetched, at its top, not following.
    fn open_operation(&mut self) {
        *self = Self::default();
    }

    /// Opens on a pending approval (it has no operation yet).
    fn open_approval(&mut self, a: &ApprovalRow) {
        *self = Self { approval: Some(Box::new(a.clone())), ..Self::default() };
    }

    /// Leaves: nothing is followed, and an approval is no longer shown (the
    /// operation stays, for `:detail` and the last-seen row).
    fn close(&mut self) {
        self.follow = false;
        self.approval = None;
    }
}

/// The help overlay's own state.
#[derive(Debug, Clone, Copy, Default)]
pub struct HelpView {
    /// Lines scrolled.
    pub scroll: u16,
    /// The mode `?` was pressed in, restored when help closes.
    pub return_to: Mode,
    /// Showing the message log (`:messages`) instead of the keys.
    pub messages: bool,
}

/// How long an informational status message stays (errors: three times as long).
pub const STATUS_TTL_MS: i64 = 8_000;
/// Status messages kept for `:messages`.
pub const MESSAGE_LOG: usize = 200;

/// Input modes: each has its own keymap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Browsing a pane.
    #[default]
    Normal,
    /// Typing a filter.
    Filter,
    /// The help overlay.
    Help,
    /// The detail view of one operation.
    Detail,
    /// A confirm dialog.
    Confirm,
    /// A form (resolve / deny / cancel note).
    Form,
    /// The lab panel (defenses off, demo databases only).
    Lab,
    /// Typing in the command bar (`:`).
    Command,
}

/// What the user (or the engine thread) asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Leave the console.
    Quit,
    /// Next / previous pane.
    NextPane,
    /// Previous pane.
    PrevPane,
    /// Jump to a pane.
    SelectPane(Pane),
    /// Selection up.
    Up,
    /// Selection down.
    Down,
    /// A page down (next keyset page at the bottom).
    PageDown,
    /// A page up.
    PageUp,
    /// First row.
    Top,
    /// Last fetched row.
    Bottom,
    /// Enter: the detail view.
    OpenDetail,
    /// `F` in the detail view: follow the operation's trace as events arrive.
    ToggleFollow,
    /// Esc: back / close.
    Back,
    /// `/`: start typing a filter.
    StartFilter,
    /// `:`: open the command bar.
    StartCommand,
    /// `s`: sort by the next column.
    CycleSort,
    /// `S`: reverse the sort.
    ReverseSort,
    /// `v`: mark / unmark the selected row.
    ToggleMark,
    /// `V`: mark every row that matches the pane's filter.
    MarkAll,
    /// Tab in the command bar: complete.
    Complete,
    /// Up in the command bar: the previous history entry.
    HistoryPrev,
    /// Down in the command bar: the next history entry.
    HistoryNext,
    /// A typed character (filter or form).
    Input(char),
    /// Backspace (filter or form).
    Backspace,
    /// Enter in a text field.
    Submit,
    /// Tab in a form / dialog: next field or button.
    NextField,
    /// Shift-Tab: previous field or button.
    PrevField,
    /// Left/right in a choice.
    ChoiceLeft,
    /// Left/right in a choice.
    ChoiceRight,
    /// `?`
    ToggleHelp,
    /// space: pause / resume live refresh.
    TogglePause,
    /// `y`: copy the selected id.
    Copy,
    /// `q`: status query on the selected unknown operation.
    AskQuery,
    /// `a`: approve the selected request.
    AskApprove,
    /// `d`: deny the selected request (note).
    AskDeny,
    /// `r`: resolve the selected operation (popup).
    AskResolve,
    /// `c`: cancel the selected accepted / in-flight operation (note, confirm).
    AskCancel,
    /// `f`: the next fault rate for the simulated agents.
    CycleFaults,
    /// `L`: open / close the lab panel.
    OpenLab,
    /// `o` in the lab panel: every defense back on.
    LabAllOn,
    /// `n`: next walkthrough step.
    ScenarioNext,
    /// Walkthrough: choose the previous / next scenario.
    ScenarioPick(i32),
    /// Mouse wheel.
    Scroll(i32),
    /// Mouse click at (column, row).
    Click(u16, u16),
    /// Terminal resized.
    Resize(u16, u16),
    /// How far the body (the detail, or the walkthrough's steps) can scroll, as last drawn.
    BodyExtent(u16),
    /// Clock tick (countdowns).
    Tick(i64),
    /// An answer from the engine thread.
    Engine(EngineEvent),
    /// A state-changing key pressed in read-only mode (what it would have done).
    ReadOnly(&'static str),
}

/// A page of rows for one pane.
#[derive(Debug, Clone, PartialEq)]
pub enum Rows {
    /// Live pane rows.
    Live(Vec<LiveRow>),
    /// Ledger / unknown rows.
    Ops(Vec<OperationRow>),
    /// Pending approvals.
    Approvals(Vec<ApprovalRow>),
    /// Operator log.
    Audit(Vec<AuditRow>),
    /// The metrics snapshot.
    Metrics(Box<crate::telemetry::metrics::MetricsSnapshot>),
    /// Nothing fetched yet.
    Empty,
}

impl Rows {
    fn len(&self) -> usize {
        match self {
            Rows::Live(r) => r.len(),
            Rows::Ops(r) => r.len(),
            Rows::Approvals(r) => r.len(),
            Rows::Audit(r) => r.len(),
            Rows::Metrics(_) | Rows::Empty => 0,
        }
    }
}

/// What the engine thread sends back.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// A fresh page for a pane, with the header counts.
    Page {
        /// For this pane.
        pane: Pane,
        /// The rows.
        rows: Rows,
        /// Header counts.
        header: HeaderCounts,
    },
    /// The detail of one operation.
    Detail(Box<OperationDetail>),
    /// An operator action finished.
    Done {
        /// Applied or not.
        ok: bool,
        /// One line for the status bar.
        summary: String,
    },
    /// The operations a `:op` prefix or a `:key` lookup found.
    Found {
        /// The lookup, for people (`op_64`, `key K in acme`).
        asked: String,
        /// The `:op` argument (put back in the bar when several match).
        prefix: Option<String>,
        /// Matching operation ids, in id order (one more than are shown, at most).
        ids: Vec<String>,
    },
    /// Every row of a pane matching its filter (`V`), at most one more than
    /// [`MAX_MARKS`].
    Marked {
        /// The pane asked about.
        pane: Pane,
        /// Its matching rows.
        marks: Vec<Mark>,
    },
    /// A bulk action's progress (after each target).
    BulkProgress {
        /// What runs.
        verb: String,
        /// Targets finished.
        done: usize,
        /// Targets.
        total: usize,
    },
    /// A bulk action finished.
    BulkDone {
        /// What ran.
        verb: String,
        /// `37 settled, 2 still unknown, 1 refused: lease held`.
        summary: String,
        /// The targets acted on (unmarked now).
        acted: Vec<String>,
        /// Nothing was refused or left unknown.
        ok: bool,
    },
    /// A resolve the engine refused because only a decision against the
    /// evidence can pass (the provider's evidence contradicts it, or a receipt
    /// may still appear): the console offers that, in its own confirm.
    Contradicted {
        /// The refusal's code (`STATUS_CONFLICT`, `RECEIPT_MAY_STILL_APPEAR`).
        code: String,
        /// The engine's words: what contradicts the decision.
        why: String,
        /// The refused request.
        request: Box<Request>,
    },
    /// Of the Ledger page that follows, the operations a person acted on
    /// (never purged: no retention countdown for them).
    ActedOn(Vec<String>),
    /// A walkthrough step ran.
    Walkthrough(WalkthroughView),
    /// The lab's state (with every refresh).
    Lab(LabView),
    /// The tools whose downstream cannot be asked (sent once, at start).
    Tools {
        /// Their names.
        unaskable: std::collections::BTreeSet<String>,
    },
    /// Refreshing the visible page failed (the database is down or
    /// unreachable): the rows on screen are the last ones fetched.
    RefreshFailed {
        /// The store's code (`DB_UNAVAILABLE` when the server is gone).
        code: String,
        /// What failed.
        error: String,
    },
    /// Something failed in the engine thread.
    Error(String),
}

/// What the walkthrough pane shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WalkthroughView {
    /// Available scenarios: (number, title).
    pub scenarios: Vec<(String, String)>,
    /// Index of the chosen one.
    pub selected: usize,
    /// Steps run so far, as table cells.
    pub steps: Vec<WalkStep>,
    /// Whether the script has more steps.
    pub more: bool,
    /// How a crash step runs here.
    pub crash_note: String,
    /// While a scenario runs, the panes show its scratch database.
    pub db_label: Option<String>,
    /// The scenario's clock while it runs: the panes measure the scratch
    /// database's ages and deadlines against it, not the wall clock.
    pub clock_ms: Option<i64>,
}

/// One executed walkthrough step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalkStep {
    /// Step number.
    pub n: usize,
    /// Action.
    pub action: String,
    /// Transition (from → to).
    pub transition: String,
    /// Retryable?
    pub retryable: String,
    /// What the user sees.
    pub user_sees: String,
    /// Effect count after the step.
    pub effects: i64,
    /// PASS / FAIL.
    pub verdict: String,
}

/// Requests for the engine thread. The console never writes the database itself.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Fetch the visible page of a pane.
    Fetch {
        /// Pane.
        pane: Pane,
        /// Filter text.
        filter: String,
        /// Order (a column of the pane's table in the store, and the direction).
        order: Order,
        /// Keyset cursor (the last row of the previous page).
        cursor: Option<Cursor>,
        /// Rows that fit on screen.
        limit: i64,
    },
    /// Load one operation's detail.
    Detail(String),
    /// Operations whose id starts with `prefix` (`:op`).
    FindOperation {
        /// What was typed.
        prefix: String,
        /// Most ids to return.
        limit: i64,
    },
    /// Operations with this idempotency key in this tenant (`:key`).
    FindByKey {
        /// The caller's key.
        key: String,
        /// Tenant.
        tenant: String,
        /// Most ids to return.
        limit: i64,
    },
    /// Explicit status query.
    Query {
        /// Operation.
        operation_id: String,
    },
    /// Approve.
    Approve {
        /// Approval id the operator saw.
        approval_id: String,
    },
    /// Deny with a note.
    Deny {
        /// Approval id.
        approval_id: String,
        /// Note.
        note: String,
    },
    /// Resolve by a human decision.
    Resolve {
        /// Operation.
        operation_id: String,
        /// Decision.
        resolution: Resolution,
        /// Note.
        note: String,
        /// Receipt id evidence.
        evidence: Option<String>,
        /// Version the operator saw.
        seen_version: i64,
        /// The operator states that no evidence exists either way (a failed
        /// decision on a tool whose downstream cannot be asked).
        no_evidence: bool,
        /// Applied although the provider's evidence contradicts it (asked
        /// only from the dialog that names the contradiction); the operator
        /// log records it as made against the evidence.
        against_evidence: bool,
    },
    /// Cancel an operation.
    Cancel {
        /// Operation.
        operation_id: String,
        /// Note.
        note: String,
        /// Version seen (the Ledger pane has it, the Live pane does not).
        seen_version: Option<i64>,
    },
    /// The simulated agents' fault rate, basis points.
    SetFaultRate(u32),
    /// Switch one defense off (demo databases only), or every defense back on.
    SetLab(Option<crate::engine::LabToggle>),
    /// Pause / resume live refresh.
    SetLive(bool),
    /// Every row of a pane that matches a filter, for `V` (in the pane's order).
    MarkAll {
        /// Pane.
        pane: Pane,
        /// Filter text.
        filter: String,
        /// Order.
        order: Order,
        /// At most this many.
        limit: i64,
    },
    /// One action on many rows, one engine call each, with progress.
    Bulk {
        /// What to do.
        action: crate::engine::BulkAction,
        /// The rows it applies to.
        targets: Vec<crate::engine::BulkTarget>,
    },
    /// Act as this operator from now on (`:operator NAME`).
    SetOperator(String),
    /// Walkthrough: choose a scenario (restarts it).
    ScenarioSelect(usize),
    /// Walkthrough: run the next step.
    ScenarioStep,
}

/// A state-changing action waiting for confirmation.
#[derive(Debug, Clone, PartialEq)]
pub struct Confirm {
    /// Dialog title.
    pub title: String,
    /// Evidence lines shown to the operator.
    pub evidence: Vec<String>,
    /// What runs on confirm.
    pub request: Request,
    /// Focus: false = Cancel (the default), true = Confirm.
    pub on_confirm: bool,
}

/// Which form is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormKind {
    /// Deny an approval.
    Deny {
        /// Approval.
        approval_id: String,
        /// What the approver would have seen (amount, order, requester, expiry).
        evidence: Vec<String>,
    },
    /// Resolve an operation.
    Resolve {
        /// Operation.
        operation_id: String,
        /// Version seen.
        seen_version: i64,
        /// Last query result, for the evidence line.
        last_query: String,
        /// The tool's downstream cannot be asked: a failed decision states
        /// that no evidence exists either way.
        unaskable: bool,
        /// What the call asked for (amount, currency, order), when it says.
        terms: Option<String>,
        /// The receipt a status query found and why it did not settle the
        /// operation (known when the form is opened from the detail view).
        found: Option<String>,
    },
    /// Cancel an operation.
    Cancel {
        /// Operation.
        operation_id: String,
        /// State seen.
        state: OpState,
        /// Version seen, when the pane shows it.
        seen_version: Option<i64>,
        /// Tool.
        tool: String,
        /// Attempts so far and the last code, when the pane shows them.
        attempts: Option<String>,
    },
    /// The note (and, for resolve, the decision) of a bulk action on marked rows.
    Bulk {
        /// The rows it applies to and the ones it skips.
        plan: BulkPlan,
    },
}

/// A text form: resolution choice, receipt id, note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Form {
    /// What the form is for.
    pub kind: FormKind,
    /// Resolution choice (0 succeeded, 1 failed, 2 compensated); none until the
    /// operator picks one (no decision is pre-selected).
    pub choice: Option<usize>,
    /// Receipt id (succeeded only).
    pub evidence: String,
    /// Note (mandatory).
    pub note: String,
    /// Focused field: 0 choice, 1 evidence, 2 note.
    pub field: usize,
    /// A validation message.
    pub error: Option<String>,
}

/// The console's whole view state.
#[derive(Debug, Clone)]
pub struct App {
    /// Database label for the header.
    pub db_label: String,
    /// Operator identity.
    pub operator: String,
    /// Read-only: state-changing keys are hidden and refused.
    pub read_only: bool,
    /// Monochrome (NO_COLOR).
    pub no_color: bool,
    /// Live refresh on?
    pub live: bool,
    /// Current pane.
    pub pane: Pane,
    /// Current mode.
    pub mode: Mode,
    /// Rows of the current pane.
    pub rows: Rows,
    /// Selected row.
    pub selected: usize,
    /// Keyset cursors of the pages above the current one.
    pub page_stack: Vec<Option<Cursor>>,
    /// Cursor of the current page.
    pub cursor: Option<Cursor>,
    /// The current pane's filter, being typed or applied.
    pub filter: String,
    /// The other panes' filters (each pane keeps its own).
    pub filters: std::collections::HashMap<Pane, String>,
    /// Named filters (`:filter save NAME`, `:filter NAME`).
    pub saved_filters: std::collections::BTreeMap<String, String>,
    /// The filter, sorts or named filters changed: the event loop saves them.
    pub prefs_dirty: bool,
    /// The applied filter while a new one is typed (Esc puts it back).
    pub filter_before: Option<String>,
    /// Marked rows, in the order marked.
    pub marks: Vec<Mark>,
    /// A bulk action running in the engine thread.
    pub bulk: Option<BulkProgress>,
    /// Each pane's order, once sorted (else its default).
    pub sorts: std::collections::HashMap<Pane, Order>,
    /// Header counts.
    pub header: HeaderCounts,
    /// The detail view: the operation or approval shown, its scroll, following.
    pub detail: DetailView,
    /// How far the body on screen (the detail, or the walkthrough's steps)
    /// can scroll, from the last draw.
    pub body_extent: u16,
    /// The open dialog (a form, then its confirm) and where it returns.
    pub dialog: DialogView,
    /// The help overlay: its scroll, the mode it returns to, and whether it
    /// shows the message log (`:messages`).
    pub help: HelpView,
    /// The command bar.
    pub command: CommandBar,
    /// Status-bar line and whether it is an error.
    pub status: Option<(String, bool)>,
    /// Now, for the ages and countdowns on screen (stands still while paused).
    pub now_ms: i64,
    /// Now, by the wall clock (status messages, refusals, the connection state).
    pub wall_ms: i64,
    /// Terminal size.
    pub size: (u16, u16),
    /// Walkthrough.
    pub walkthrough: WalkthroughView,
    /// Set when the user quits.
    pub quit: bool,
    /// Text waiting to be copied (OSC 52) by the event loop.
    pub clipboard: Option<String>,
    /// The lab's state.
    pub lab: LabView,
    /// Tools whose downstream cannot be asked (from the engine, at start).
    pub unaskable_tools: std::collections::BTreeSet<String>,
    /// `n` was pressed once past the walkthrough's last step: the next `n`
    /// starts the scenario over.
    pub walk_restart_armed: bool,
    /// When the status line was last set (it expires: [`STATUS_TTL_MS`]).
    pub status_at: i64,
    /// Every status message of the session, oldest first, at most
    /// [`MESSAGE_LOG`] (`:messages` lists them).
    pub messages: std::collections::VecDeque<(i64, String, bool)>,
    /// The toggle selected in the lab panel.
    pub lab_selected: usize,
    /// A pane switch is waiting for its first page: keys that act on rows
    /// wait in `queued` so each acts on the state the previous key left.
    pub awaiting_page: bool,
    /// Keys typed before the page they act on arrived, in order.
    pub queued: std::collections::VecDeque<Action>,
    /// Requests produced by replaying queued keys (the event loop sends them).
    pub pending_requests: Vec<Request>,
    /// Refreshes fail: since when, and the store's code (the header says so
    /// instead of `LIVE`, with the time of the rows shown).
    pub db_down: Option<(i64, String)>,
    /// When the rows on screen were fetched.
    pub rows_at: Option<i64>,
    /// Operations of the Ledger page a person acted on (never purged).
    pub acted_on: std::collections::HashSet<String>,
    /// How far the walkthrough's steps are scrolled (`u16::MAX`: the end).
    pub walk_scroll: u16,
    /// Walkthrough requests (picks, steps) not answered yet.
    pub walk_pending: usize,
}

/// The smallest terminal every pane is laid out for; below it the console
/// only says what it needs, and takes no key but quit.
pub const MIN_SIZE: (u16, u16) = (80, 24);

/// Rows of chrome around a pane's table: header (3), tabs (1), table border and
/// header (3), footer (2).
pub const CHROME_ROWS: u16 = 9;

impl App {
    /// A fresh console.
    pub fn new(
        db_label: impl Into<String>,
        operator: impl Into<String>,
        read_only: bool,
        no_color: bool,
        now_ms: i64,
    ) -> Self {
        Self {
            db_label: db_label.into(),
            operator: operator.into(),
            read_only,
            no_color,
            live: true,
            pane: Pane::Unknown,
            mode: Mode::Normal,
            rows: Rows::Empty,
            selected: 0,
            page_stack: Vec::new(),
            cursor: None,
            filter: String::new(),
            filters: std::collections::HashMap::new(),
            saved_filters: std::collections::BTreeMap::new(),
            prefs_dirty: false,
            filter_before: None,
            marks: Vec::new(),
            bulk: None,
            sorts: std::collections::HashMap::new(),
            header: HeaderCounts::default(),
            detail: DetailView::default(),
            // Nothing drawn yet: no limit on scrolling until the first draw says.
            body_extent: u16::MAX,
            dialog: DialogView::default(),
            help: HelpView::default(),
            command: CommandBar::default(),
            status: None,
            now_ms,
            size: (80, 24),
            walkthrough: WalkthroughView::default(),
            quit: false,
            clipboard: None,
            lab: LabView::default(),
            unaskable_tools: std::collections::BTreeSet::new(),
            walk_restart_armed: false,
            status_at: now_ms,
            wall_ms: now_ms,
            messages: std::collections::VecDeque::new(),
            lab_selected: 0,
            awaiting_page: false,
            queued: std::collections::VecDeque::new(),
            pending_requests: Vec::new(),
            db_down: None,
            rows_at: None,
            acted_on: std::collections::HashSet::new(),
            walk_scroll: u16::MAX,
            walk_pending: 0,
        }
    }

    /// The terminal is below [`MIN_SIZE`]: nothing is drawn but what it needs.
    pub fn too_small(&self) -> bool {
        self.size.0 < MIN_SIZE.0 || self.size.1 < MIN_SIZE.1
    }

    /// Keys scroll the walkthrough's steps (its pane, browsing).
    fn walk_scrolls(&self) -> bool {
        self.pane == Pane::Walkthrough && self.mode == Mode::Normal
    }

    /// How many table rows fit.
    /// How many rows the current pane's whole list holds, when the header's
    /// counts say it (no filter set: a filter's total is not counted).
    pub fn pane_total(&self) -> Option<i64> {
        if !self.filter.is_empty() {
            return None;
        }
        let state = |names: &[&str]| -> i64 {
            self.header.by_state.iter().filter(|(s, _)| names.contains(&s.as_str())).map(|(_, n)| *n).sum()
        };
        match self.pane {
            Pane::Unknown => Some(state(&["unknown", "needs_review"])),
            Pane::Approvals => Some(self.header.pending_approvals),
            Pane::Ledger => Some(self.header.by_state.iter().map(|(_, n)| *n).sum()),
            _ => None,
        }
    }

    pub fn visible_rows(&self) -> i64 {
        i64::from(self.size.1.saturating_sub(CHROME_ROWS).max(1))
    }

    /// The request that fetches the current view.
    pub fn fetch(&self) -> Request {
        Request::Fetch {
            pane: self.pane,
            filter: self.filter.clone(),
            order: self.order(),
            cursor: self.cursor.clone(),
            limit: self.visible_rows(),
        }
    }

    fn row_count(&self) -> usize {
        self.rows.len()
    }

    /// The id the selected row is about (operation or approval).
    pub fn selected_id(&self) -> Option<String> {
        match &self.rows {
            Rows::Live(r) => r.get(self.selected).map(|x| x.operation_id.clone()),
            Rows::Ops(r) => r.get(self.selected).map(|x| x.id.clone()),
            Rows::Approvals(r) => r.get(self.selected).map(|x| x.id.clone()),
            Rows::Audit(r) => {
                r.get(self.selected).and_then(|x| x.operation_id.clone().or_else(|| x.approval_id.clone()))
            }
            Rows::Metrics(_) | Rows::Empty => None,
        }
    }

    /// The operation an action is about: the one in the detail view, or the
    /// selected row of an operations pane.
    fn selected_op(&self) -> Option<&OperationRow> {
        if self.mode == Mode::Detail {
            return self.detail.op.as_ref().map(|d| &d.operation);
        }
        match &self.rows {
            Rows::Ops(r) => r.get(self.selected),
            _ => None,
        }
    }

    /// The approval an action is about: the one in the detail view, or the
    /// selected row of the Approvals pane.
    fn selected_approval(&self) -> Option<&ApprovalRow> {
        if self.mode == Mode::Detail {
            return self.detail.approval.as_deref();
        }
        match &self.rows {
            Rows::Approvals(r) => r.get(self.selected),
            _ => None,
        }
    }

    fn switch_pane(&mut self, pane: Pane) -> Option<Request> {
        if self.pane == pane {
            return None;
        }
        let old = std::mem::replace(&mut self.pane, pane);
        let mine = self.filters.remove(&pane).unwrap_or_default();
        let theirs = std::mem::replace(&mut self.filter, mine);
        if !theirs.is_empty() {
            self.filters.insert(old, theirs);
        }
        self.rows = Rows::Empty;
        self.selected = 0;
        self.cursor = None;
        self.page_stack.clear();
        self.awaiting_page = pane.paged();
        Some(self.fetch())
    }

    /// Whether an action acts on the rows of the current pane (and so must wait
    /// for them after a pane switch).
    fn acts_on_rows(&self, action: &Action) -> bool {
        self.mode == Mode::Normal
            && matches!(
                action,
                Action::Up
                    | Action::Down
                    | Action::Top
                    | Action::Bottom
                    | Action::PageDown
                    | Action::PageUp
                    | Action::OpenDetail
                    | Action::Copy
                    | Action::AskQuery
                    | Action::AskApprove
                    | Action::AskDeny
                    | Action::AskResolve
                    | Action::AskCancel
                    | Action::CycleSort
                    | Action::ReverseSort
                    | Action::ToggleMark
                    | Action::MarkAll
            )
    }

    /// The action keys act on the marks: there are some, and the key was pressed
    /// in a pane (the detail view acts on its own operation).
    fn bulk_keys(&self) -> bool {
        !self.marks.is_empty() && self.mode == Mode::Normal
    }

    /// Sets this pane's filter (checked against the pane's fields first) and
    /// goes back to its first page; the caller fetches.
    fn apply_filter(&mut self, text: &str) -> Result<(), String> {
        let text: String = text.chars().filter(|c| !c.is_control()).take(filter::MAX_FILTER).collect();
        filter::parse_for(&text, self.pane)?;
        self.mode = Mode::Normal;
        self.prefs_dirty = true;
        self.filter = text;
        self.cursor = None;
        self.page_stack.clear();
        self.selected = 0;
        Ok(())
    }

    fn say(&mut self, text: impl Into<String>, error: bool) {
        let text = text.into();
        if self.messages.len() == MESSAGE_LOG {
            self.messages.pop_front();
        }
        self.messages.push_back((self.wall_ms, text.clone(), error));
        self.status = Some((text, error));
        self.status_at = self.wall_ms;
    }

    /// An action that does not apply: in the detail view, to this operation's
    /// state; in a pane, to the selection (`pane_text`).
    fn say_not_applicable(&mut self, what: &str, pane_text: &str) {
        let text = match self.detail.op.as_ref().filter(|_| self.mode == Mode::Detail) {
            Some(d) => format!("{} is {}: cannot {what}", d.operation.id, d.operation.state),
            None => pane_text.to_string(),
        };
        self.say(text, true);
    }

    fn refuse_read_only(&mut self) -> bool {
        if self.read_only {
            self.say("read-only: state-changing actions are disabled", true);
        }
        self.read_only
    }

    fn ago(&self, at: Option<i64>) -> String {
        super::format::ago(self.now_ms, at)
    }

    /// Handles one action; returns a request for the engine thread, if any.
    /// (Keys replayed after a page arrived leave theirs in `pending_requests`.)
    pub fn update(&mut self, action: Action) -> Option<Request> {
        // Keys typed in one burst act in order on the state each leaves: one
        // that needs the rows of a pane just switched to waits for them.
        if self.awaiting_page
            && (self.acts_on_rows(&action)
                || (!self.queued.is_empty()
                    && !matches!(action, Action::Engine(_) | Action::Tick(_) | Action::Resize(..))))
        {
            self.queued.push_back(action);
            return None;
        }
        let arrived = matches!(&action, Action::Engine(EngineEvent::Page { pane, .. }) if *pane == self.pane);
        let out = self.update_now(action);
        if arrived && self.awaiting_page {
            self.awaiting_page = false;
            if let Some(r) = out.clone() {
                self.pending_requests.push(r);
            }
            while let Some(next) = self.queued.pop_front() {
                if let Some(r) = self.update(next) {
                    self.pending_requests.push(r);
                }
                if self.awaiting_page {
                    // A queued key switched panes again: the rest waits for that page.
                    break;
                }
            }
            // Every request of the replay waits in `pending_requests`, in order.
            return None;
        }
        out
    }

    fn update_now(&mut self, action: Action) -> Option<Request> {
        let from = self.mode;
        let out = self.update_mode(action);
        let dialog = |m: Mode| matches!(m, Mode::Confirm | Mode::Form);
        if dialog(self.mode) && !dialog(from) {
            self.dialog.return_to = if from == Mode::Detail { Mode::Detail } else { Mode::Normal };
        }
        out
    }

    fn update_mode(&mut self, action: Action) -> Option<Request> {
        if self.mode == Mode::Help {
            match action {
                Action::Up | Action::Scroll(-1) => {
                    self.help.scroll = self.help.scroll.saturating_sub(1);
                    return None;
                }
                Action::Down | Action::Scroll(1) => {
                    self.help.scroll = self.help.scroll.saturating_add(1).min(200);
                    return None;
                }
                Action::ToggleHelp | Action::Back | Action::Tick(_) | Action::Engine(_) | Action::Resize(..) => {}
                _ => self.mode = self.help.return_to,
            }
        }
        if let lab::Intercept::Handled(r) = self.lab_intercept(&action) {
            return r;
        }
        match action {
            Action::Quit => {
                self.quit = true;
                None
            }
            Action::Tick(now) => self.on_tick(now),
            Action::Resize(w, h) => {
                let grew = h > self.size.1;
                self.size = (w, h);
                grew.then(|| self.fetch())
            }
            Action::Engine(ev) => self.on_engine(ev),
            Action::ReadOnly(what) => {
                self.say(
                    format!("read-only (--read-only): \"{what}\" changes the ledger and is disabled; restart without --read-only to act"),
                    true,
                );
                None
            }
            Action::ToggleHelp => {
                if self.mode == Mode::Help {
                    self.mode = self.help.return_to;
                } else {
                    self.help.return_to = self.mode;
                    self.help.scroll = 0;
                    self.help.messages = false;
                    self.mode = Mode::Help;
                }
                None
            }
            Action::NextPane => self.switch_pane(Pane::ALL[(self.pane.index() + 1) % Pane::ALL.len()]),
            Action::PrevPane => {
                self.switch_pane(Pane::ALL[(self.pane.index() + Pane::ALL.len() - 1) % Pane::ALL.len()])
            }
            Action::SelectPane(p) => self.switch_pane(p),
            // The walkthrough's steps scroll (the pane has no rows to select).
            action @ (Action::Up
            | Action::Down
            | Action::Scroll(_)
            | Action::Top
            | Action::Bottom
            | Action::PageUp
            | Action::PageDown
            | Action::BodyExtent(_)) => self.navigate(&action),
            Action::Click(_, row) => {
                // Table body starts below header (3), tabs (1), border + column header (2).
                let first = 6u16;
                if row >= first {
                    let i = usize::from(row - first);
                    if i < self.row_count() {
                        self.selected = i;
                    }
                }
                None
            }
            Action::OpenDetail => self.open_detail(),
            Action::ToggleFollow => self.toggle_follow(),
            Action::Back => self.back(),
            Action::StartFilter => {
                self.filter_before = Some(self.filter.clone());
                self.mode = Mode::Filter;
                None
            }
            Action::StartCommand => self.start_command(),
            Action::ToggleMark => self.toggle_mark(),
            Action::MarkAll => self.mark_all(),
            Action::CycleSort => self.cycle_sort(),
            Action::ReverseSort => self.reverse_sort(),
            Action::Complete => {
                let names: Vec<String> = self.saved_filters.keys().cloned().collect();
                self.command.complete(&sort::columns(self.pane), &names);
                None
            }
            Action::HistoryPrev => {
                self.command.older();
                None
            }
            Action::HistoryNext => {
                self.command.newer();
                None
            }
            Action::Input(c) => self.on_input(c),
            Action::Backspace => self.backspace(),
            Action::Submit => self.on_submit(),
            Action::NextField | Action::PrevField | Action::ChoiceLeft | Action::ChoiceRight => {
                self.on_navigate(&action);
                None
            }
            Action::TogglePause => {
                self.live = !self.live;
                self.now_ms = self.wall_ms;
                self.say(if self.live { "live refresh resumed" } else { "paused: the panes stop refreshing" }, false);
                Some(Request::SetLive(self.live))
            }
            Action::Copy => {
                let id = match (self.detail.op.as_ref(), self.detail.approval.as_ref()) {
                    (_, Some(a)) if self.mode == Mode::Detail => Some(a.id.clone()),
                    (Some(d), _) if self.mode == Mode::Detail => Some(d.operation.id.clone()),
                    _ => self.selected_id(),
                };
                if let Some(id) = id {
                    self.say(format!("copied {id}"), false);
                    self.clipboard = Some(id);
                }
                None
            }
            Action::AskQuery if self.bulk_keys() => self.ask_bulk(BulkKey::Query),
            Action::AskApprove if self.bulk_keys() => self.ask_bulk(BulkKey::Approve),
            Action::AskDeny if self.bulk_keys() => self.ask_bulk(BulkKey::Deny),
            Action::AskResolve if self.bulk_keys() => self.ask_bulk(BulkKey::Resolve),
            Action::AskCancel if self.bulk_keys() => self.ask_bulk(BulkKey::Cancel),
            Action::AskQuery => self.ask_query(),
            Action::AskApprove => self.ask_approve(),
            Action::AskDeny => self.ask_deny(),
            Action::AskResolve => self.ask_resolve(),
            Action::AskCancel => self.ask_cancel(),
            Action::CycleFaults => self.cycle_faults(),
            Action::OpenLab => self.open_lab(),
            Action::LabAllOn => self.lab_all_on(),
            Action::ScenarioNext => self.scenario_next(),
            Action::ScenarioPick(d) => self.scenario_pick(d),
        }
    }

    fn on_tick(&mut self, now: i64) -> Option<Request> {
        self.wall_ms = now;
        // Paused, the screen is a snapshot: its ages and countdowns
        // stand still with its rows (messages still expire).
        if self.live {
            // A scenario's scratch database is measured on its own clock.
            self.now_ms = self.walkthrough.clock_ms.unwrap_or(now);
        }
        // A message says what just happened: once the state moved on,
        // it goes (the log keeps it).
        let ttl = match &self.status {
            Some((_, true)) => STATUS_TTL_MS * 3,
            _ => STATUS_TTL_MS,
        };
        if self.status.is_some() && now.saturating_sub(self.status_at) > ttl {
            self.status = None;
        }
        None
    }

    fn open_detail(&mut self) -> Option<Request> {
        // A pending approval has no operation yet: its detail is the
        // approval itself, with why it waits and what to press.
        if let Rows::Approvals(r) = &self.rows {
            if let Some(a) = r.get(self.selected).filter(|a| a.operation_id.is_none()) {
                self.detail.open_approval(a);
                self.mode = Mode::Detail;
                return None;
            }
        }
        let id = match &self.rows {
            Rows::Approvals(r) => r.get(self.selected).and_then(|a| a.operation_id.clone()),
            _ => self.selected_id().filter(|id| id.starts_with("op_")),
        };
        if let Some(id) = id {
            self.mode = Mode::Detail;
            self.detail.open_operation();
            Some(Request::Detail(id))
        } else {
            self.say("no operation selected", true);
            None
        }
    }

    fn back(&mut self) -> Option<Request> {
        match self.mode {
            Mode::Detail => {
                self.detail.close();
                self.mode = Mode::Normal;
            }
            Mode::Help | Mode::Lab => self.mode = Mode::Normal,
            Mode::Filter => {
                // Esc cancels the edit: the filter in force stays.
                if let Some(before) = self.filter_before.take() {
                    self.filter = before;
                }
                self.mode = Mode::Normal;
            }
            Mode::Command => {
                self.command.open();
                self.mode = self.command.return_to;
            }
            Mode::Confirm => {
                self.dialog.confirm = None;
                self.mode = self.dialog.return_to;
                self.say("went back: nothing was done", false);
            }
            Mode::Form => {
                self.dialog.form = None;
                self.mode = self.dialog.return_to;
                self.say("went back: nothing was done", false);
            }
            Mode::Normal => {
                if !self.marks.is_empty() {
                    self.clear_marks();
                } else if !self.filter.is_empty() {
                    self.filter.clear();
                    self.prefs_dirty = true;
                    self.cursor = None;
                    self.page_stack.clear();
                    return Some(self.fetch());
                }
            }
        }
        None
    }

    fn backspace(&mut self) -> Option<Request> {
        match self.mode {
            Mode::Filter => {
                self.filter.pop();
            }
            Mode::Command => self.command.pop(),
            Mode::Form => {
                if let Some(f) = self.dialog.form.as_mut() {
                    match f.field {
                        1 => {
                            f.evidence.pop();
                        }
                        2 => {
                            f.note.pop();
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        None
    }

    fn ask_deny(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let Some(a) = self.selected_approval() else {
            self.say("select a pending approval (pane 3) to deny", true);
            return None;
        };
        if let Err(why) = self.may_decide(a) {
            self.say(why, true);
            return None;
        }
        let a = a.clone();
        let evidence = self.approval_evidence(&a);
        self.dialog.form = Some(Form {
            kind: FormKind::Deny { approval_id: a.id.clone(), evidence },
            choice: None,
            evidence: String::new(),
            note: String::new(),
            field: 2,
            error: None,
        });
        self.mode = Mode::Form;
        None
    }

    fn ask_resolve(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let Some(op) = self.selected_op().filter(|o| o.state.is_unknown_queue()) else {
            self.say_not_applicable(
                "resolve it (only unknown or needs_review)",
                "select an unknown or needs_review operation (pane 4) to resolve",
            );
            return None;
        };
        let found = self
            .detail
            .op
            .as_deref()
            .filter(|d| self.mode == Mode::Detail && d.operation.id == op.id)
            .and_then(found_receipt)
            .filter(|r| op.receipt_id.as_deref() != Some(r.receipt_id.as_str()))
            .map(|r| match &r.why_not {
                Some(w) => format!("{}: {}", r.ids(), w),
                None => r.ids(),
            });
        let kind = FormKind::Resolve {
            operation_id: op.id.clone(),
            seen_version: op.version,
            unaskable: self.unaskable_tools.contains(&op.tool),
            terms: request_terms(op),
            found,
            last_query: format!(
                "{} ({})",
                op.last_query_result.clone().unwrap_or_else(|| "no query yet".into()),
                self.ago(op.last_query_at)
            ),
        };
        self.dialog.form =
            Some(Form { kind, choice: None, evidence: String::new(), note: String::new(), field: 0, error: None });
        self.mode = Mode::Form;
        None
    }

    fn scenario_next(&mut self) -> Option<Request> {
        if self.pane != Pane::Walkthrough {
            return None;
        }
        // Past the last step, one `n` says so; a second starts over
        // (a silent restart lost the finished run from the screen).
        let finished = !self.walkthrough.more && !self.walkthrough.steps.is_empty();
        if finished && !self.walk_restart_armed {
            self.walk_restart_armed = true;
            self.say("the scenario is finished: n again starts it over on a new database", false);
            return None;
        }
        self.walk_restart_armed = false;
        self.walk_pending += 1;
        Some(Request::ScenarioStep)
    }

    fn scenario_pick(&mut self, d: i32) -> Option<Request> {
        if self.pane != Pane::Walkthrough || self.walkthrough.scenarios.is_empty() {
            return None;
        }
        // From the scenario last picked, not the last one the engine
        // answered: `]]]` typed at once moves three.
        let n = self.walkthrough.scenarios.len() as i32;
        let i = (self.walkthrough.selected as i32 + d).rem_euclid(n) as usize;
        self.walkthrough.selected = i;
        self.walk_pending += 1;
        Some(Request::ScenarioSelect(i))
    }

    /// Moving: the walkthrough scrolls, the detail scrolls, or the selection moves.
    fn navigate(&mut self, action: &Action) -> Option<Request> {
        match *action {
            Action::Up | Action::Scroll(-1) if self.walk_scrolls() => {
                self.walk_scroll = self.walk_scroll.min(self.body_extent).saturating_sub(1);
                None
            }
            Action::Down | Action::Scroll(1) if self.walk_scrolls() => {
                self.walk_scroll = self.walk_scroll.min(self.body_extent).saturating_add(1).min(self.body_extent);
                None
            }
            Action::Top if self.walk_scrolls() => {
                self.walk_scroll = 0;
                None
            }
            Action::Bottom if self.walk_scrolls() => {
                self.walk_scroll = u16::MAX;
                None
            }
            Action::PageUp if self.walk_scrolls() => {
                let page = self.size.1.saturating_sub(14).max(1);
                self.walk_scroll = self.walk_scroll.min(self.body_extent).saturating_sub(page);
                None
            }
            Action::PageDown if self.walk_scrolls() => {
                let page = self.size.1.saturating_sub(14).max(1);
                self.walk_scroll = self.walk_scroll.saturating_add(page).min(self.body_extent);
                None
            }
            Action::Up | Action::Scroll(-1) => {
                if self.mode == Mode::Detail {
                    self.stop_following();
                    self.detail.scroll = self.detail.scroll.saturating_sub(1);
                } else {
                    self.selected = self.selected.saturating_sub(1);
                }
                None
            }
            Action::BodyExtent(n) => {
                self.body_extent = n;
                self.detail.scroll = self.detail.scroll.min(n);
                None
            }
            Action::Down | Action::Scroll(1) => {
                if self.mode == Mode::Detail {
                    self.stop_following();
                    self.detail.scroll = self.detail.scroll.saturating_add(1).min(self.body_extent);
                } else if self.selected + 1 < self.row_count() {
                    self.selected += 1;
                }
                None
            }
            Action::Scroll(_) => None,
            Action::Top if self.mode == Mode::Detail => {
                self.stop_following();
                self.detail.scroll = 0;
                None
            }
            Action::Bottom if self.mode == Mode::Detail => {
                self.stop_following();
                self.detail.scroll = self.body_extent;
                None
            }
            Action::PageDown if self.mode == Mode::Detail => {
                self.stop_following();
                let page = self.size.1.saturating_sub(8).max(1);
                self.detail.scroll = self.detail.scroll.saturating_add(page).min(self.body_extent);
                None
            }
            Action::PageUp if self.mode == Mode::Detail => {
                self.stop_following();
                let page = self.size.1.saturating_sub(8).max(1);
                self.detail.scroll = self.detail.scroll.saturating_sub(page);
                None
            }
            Action::Top => {
                self.selected = 0;
                if self.cursor.is_some() {
                    self.cursor = None;
                    self.page_stack.clear();
                    return Some(self.fetch());
                }
                None
            }
            Action::Bottom => {
                self.selected = self.row_count().saturating_sub(1);
                None
            }
            Action::PageDown => self.page_down(),
            Action::PageUp => self.page_up(),
            _ => None,
        }
    }

    /// `F` in the detail view: start following its operation (fetched again at
    /// once and on every change of the ledger) or stop.
    fn toggle_follow(&mut self) -> Option<Request> {
        if self.detail.follow {
            self.stop_following();
            return None;
        }
        let id = self.detail.op.as_ref().filter(|_| self.mode == Mode::Detail).map(|d| d.operation.id.clone())?;
        self.detail.follow = true;
        self.say(format!("following {id}: new trace events appear at the end (F or j/k stops)"), false);
        Some(Request::Detail(id))
    }

    fn stop_following(&mut self) {
        if std::mem::take(&mut self.detail.follow) {
            self.say("stopped following", false);
        }
    }

    fn page_down(&mut self) -> Option<Request> {
        let key = self.next_cursor();
        if (self.row_count() as i64) < self.visible_rows() || key.is_none() {
            self.selected = self.row_count().saturating_sub(1);
            return None;
        }
        self.page_stack.push(self.cursor.take());
        self.cursor = key;
        self.selected = 0;
        Some(self.fetch())
    }

    fn page_up(&mut self) -> Option<Request> {
        self.selected = 0;
        let prev = self.page_stack.pop()?;
        self.cursor = prev;
        Some(self.fetch())
    }

    fn on_engine(&mut self, ev: EngineEvent) -> Option<Request> {
        match ev {
            EngineEvent::Page { pane, rows, header } => {
                self.header = header;
                self.rows_at = Some(self.wall_ms);
                if let Some((since, _)) = self.db_down.take() {
                    self.say(
                        format!(
                            "the database is back (down since {}): the panes are live again",
                            super::format::time_of_day(since)
                        ),
                        false,
                    );
                }
                // A page comes whenever the ledger changed (and every few
                // seconds): a followed detail is fetched again with it.
                let followed = self
                    .detail
                    .op
                    .as_ref()
                    .filter(|_| self.detail.follow && self.mode == Mode::Detail)
                    .map(|d| Request::Detail(d.operation.id.clone()));
                if pane == self.pane {
                    // Keep the selection on the same row when rows move.
                    let keep = row_key(&self.rows, self.selected);
                    self.rows = rows;
                    if let Some(k) = keep {
                        if let Some(i) =
                            (0..self.row_count()).find(|i| row_key(&self.rows, *i).as_deref() == Some(k.as_str()))
                        {
                            self.selected = i;
                        }
                    }
                    if self.selected >= self.row_count() {
                        self.selected = self.row_count().saturating_sub(1);
                    }
                }
                followed
            }
            EngineEvent::Detail(d) => {
                self.detail.op = Some(d);
                None
            }
            EngineEvent::Done { ok, summary } => {
                self.say(summary, !ok);
                // An approval decided from its detail view is no longer pending:
                // back to the pane, which the fetch below refreshes.
                if self.mode == Mode::Detail && self.detail.approval.take().is_some() {
                    self.mode = Mode::Normal;
                }
                // An action taken from the detail view: show what it changed there too.
                if let Some(d) = self.detail.op.as_ref().filter(|_| self.mode == Mode::Detail) {
                    self.pending_requests.push(Request::Detail(d.operation.id.clone()));
                }
                Some(self.fetch())
            }
            EngineEvent::Found { asked, prefix, ids } => self.on_found(&asked, prefix.as_deref(), ids),
            EngineEvent::Marked { pane, marks } => {
                self.on_marked(pane, marks);
                None
            }
            EngineEvent::BulkProgress { verb, done, total } => {
                self.on_bulk_progress(verb, done, total);
                None
            }
            EngineEvent::BulkDone { verb, summary, acted, ok } => Some(self.on_bulk_done(&verb, &summary, &acted, ok)),
            EngineEvent::Lab(v) => {
                self.lab = v;
                None
            }
            EngineEvent::Tools { unaskable } => {
                self.unaskable_tools = unaskable;
                None
            }
            EngineEvent::ActedOn(ids) => {
                self.acted_on = ids.into_iter().collect();
                None
            }
            EngineEvent::Contradicted { code, why, request } => Some(self.on_contradicted(&code, &why, *request)),
            EngineEvent::Walkthrough(w) => {
                let picked = self.walkthrough.selected;
                if w.steps.len() != self.walkthrough.steps.len() {
                    // A step ran (or the scenario changed): the newest in view.
                    self.walk_scroll = u16::MAX;
                }
                self.walkthrough = w;
                if self.live {
                    self.now_ms = self.walkthrough.clock_ms.unwrap_or(self.wall_ms);
                }
                // Answers to earlier picks still coming: the last pick stays shown.
                self.walk_pending = self.walk_pending.saturating_sub(1);
                if self.walk_pending > 0 {
                    self.walkthrough.selected = picked;
                }
                None
            }
            EngineEvent::RefreshFailed { code, error } => {
                // Said once; the header keeps saying it while it lasts.
                if self.db_down.is_none() {
                    self.say(format!("refresh failed: {code}: {error}; the rows shown are not live"), true);
                    self.db_down = Some((self.wall_ms, code));
                }
                None
            }
            EngineEvent::Error(e) => {
                self.say(e, true);
                None
            }
        }
    }

    /// A resolve refused on the provider's evidence: said, and the same
    /// decision offered against the evidence in a confirm that names the
    /// contradiction (Go back focused). The pane (and detail) refresh.
    fn on_contradicted(&mut self, code: &str, why: &str, request: Request) -> Request {
        let Request::Resolve {
            operation_id,
            resolution,
            note,
            evidence,
            seen_version,
            no_evidence,
            against_evidence: false,
        } = request
        else {
            self.say(format!("{code}: {why}"), true);
            return self.fetch();
        };
        self.say(format!("resolve {operation_id}: {code} {why}"), true);
        if let Some(d) = self.detail.op.as_ref().filter(|_| self.mode == Mode::Detail) {
            self.pending_requests.push(Request::Detail(d.operation.id.clone()));
        }
        // Another dialog opened meanwhile: the status line (and the log) say it.
        if !matches!(self.mode, Mode::Normal | Mode::Detail) {
            return self.fetch();
        }
        let lines = vec![
            format!("operation   {operation_id} (version {seen_version})"),
            format!("resolve as  {}, AGAINST the provider's evidence", resolution.as_str()),
            format!("contradicts {code}: {why}"),
            format!("evidence    {}", evidence.as_deref().unwrap_or("-")),
            format!("note        {note}"),
            "the operator log records it as decided against the evidence".to_string(),
        ];
        self.dialog.confirm = Some(Confirm {
            title: "Decide against the evidence".into(),
            evidence: lines,
            request: Request::Resolve {
                operation_id,
                resolution,
                note,
                evidence,
                seen_version,
                no_evidence,
                against_evidence: true,
            },
            on_confirm: false,
        });
        self.mode = Mode::Confirm;
        self.fetch()
    }

    fn ask_query(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let Some(op) = self.selected_op().filter(|o| !o.state.is_terminal()) else {
            self.say_not_applicable("query its status", "select an unknown operation (pane 4) to query its status");
            return None;
        };
        let evidence = vec![
            format!("operation   {}", op.id),
            format!("state       {} (version {})", op.state, op.version),
            format!("status_ref  {}", crate::display::clip(&crate::display::escape(&op.status_ref), 21)),
            format!(
                "last query  {} ({})",
                op.last_query_result.as_deref().unwrap_or("none"),
                self.ago(op.last_query_at)
            ),
            "asks the provider for a receipt; never executes the tool".to_string(),
        ];
        self.dialog.confirm = Some(Confirm {
            title: "Status query".into(),
            evidence,
            request: Request::Query { operation_id: op.id.clone() },
            on_confirm: false,
        });
        self.mode = Mode::Confirm;
        None
    }

    /// The tenant's approvers, for the dialog and the refusals.
    fn approvers_of(&self, tenant: &str) -> String {
        self.header
            .approvers
            .get(tenant)
            .filter(|l| !l.is_empty())
            .map_or_else(|| "nobody".to_string(), |l| l.join(", "))
    }

    /// Whether this operator may decide this approval now; the reason if not
    /// (said before any dialog opens, as the engine would refuse it after).
    pub fn may_decide(&self, a: &ApprovalRow) -> Result<(), String> {
        // The wall clock: a paused screen does not make a request younger.
        if self.wall_ms >= a.expires_at {
            return Err(format!(
                "{} expired {} ago (expiry is exclusive): it can no longer be approved or denied; the agent's next call asks anew",
                a.id,
                super::format::human_ms(self.wall_ms.saturating_sub(a.expires_at))
            ));
        }
        let allowed = self.header.approvers.get(&a.tenant).is_some_and(|l| l.contains(&self.operator));
        if !allowed {
            return Err(format!(
                "{} is not on {}'s approver list (may approve: {}); act as one of them with :operator NAME",
                self.operator,
                a.tenant,
                self.approvers_of(&a.tenant)
            ));
        }
        if self.operator == a.subject {
            return Err(format!("{} requested this call and cannot approve or deny it", self.operator));
        }
        Ok(())
    }

    /// What an approver sees before approving or denying: from the bound,
    /// digest-checked request (amount as money, order), who asked, the expiry.
    pub fn approval_evidence(&self, a: &ApprovalRow) -> Vec<String> {
        let amount = match (super::format::approval_money(a), crate::engine::approval_amount(a)) {
            (Some(m), Some(minor)) => format!("{m}  ({minor} minor units)"),
            _ => "- (none, or the record is damaged: toolgate audit)".to_string(),
        };
        let order = crate::engine::approval_amount(a)
            .is_some()
            .then(|| serde_json::from_str::<serde_json::Value>(&a.request_json).ok())
            .flatten()
            .and_then(|v| v["arguments"]["order_ref"].as_str().map(|s| super::format::short(s, 40)));
        let mut evidence = vec![
            format!("approval    {}", a.id),
            format!("tool        {}  tenant {}  requester {}", a.tool, a.tenant, a.subject),
            format!("amount      {amount}"),
        ];
        if let Some(o) = order {
            evidence.push(format!("order       {o}"));
        }
        evidence.extend([
            format!("request     {}…", crate::display::digest(&a.request_sha256, 16)),
            format!("expires     {}", super::format::lapses_at(self.now_ms, a.expires_at)),
            format!("approver    {}  (may approve: {})", self.operator, self.approvers_of(&a.tenant)),
        ]);
        evidence
    }

    fn ask_approve(&mut self) -> Option<Request> {
        if self.refuse_read_only() {
            return None;
        }
        let Some(a) = self.selected_approval() else {
            self.say("select a pending approval (pane 3) to approve", true);
            return None;
        };
        if let Err(why) = self.may_decide(a) {
            self.say(why, true);
            return None;
        }
        let a = a.clone();
        let evidence = self.approval_evidence(&a);
        self.dialog.confirm = Some(Confirm {
            title: "Approve and execute".into(),
            evidence,
            request: Request::Approve { approval_id: a.id.clone() },
            on_confirm: false,
        });
        self.mode = Mode::Confirm;
        None
    }

    fn on_input(&mut self, c: char) -> Option<Request> {
        match self.mode {
            Mode::Filter => {
                if self.filter.chars().count() < filter::MAX_FILTER && !c.is_control() {
                    self.filter.push(c);
                }
                None
            }
            Mode::Command => {
                self.command.push(c);
                None
            }
            Mode::Form => {
                if let Some(f) = self.dialog.form.as_mut() {
                    let target = match f.field {
                        1 => Some(&mut f.evidence),
                        2 => Some(&mut f.note),
                        _ => None,
                    };
                    if let Some(t) = target {
                        if t.len() < 200 && !c.is_control() {
                            t.push(c);
                        }
                    }
                }
                None
            }
            _ => None,
        }
    }

    fn on_navigate(&mut self, action: &Action) {
        match self.mode {
            Mode::Confirm => {
                if let Some(c) = self.dialog.confirm.as_mut() {
                    c.on_confirm = !c.on_confirm;
                }
            }
            Mode::Form => {
                if let Some(f) = self.dialog.form.as_mut() {
                    let fields: &[usize] = match f.kind {
                        FormKind::Deny { .. } | FormKind::Cancel { .. } => &[2],
                        FormKind::Bulk { ref plan } if plan.key == BulkKey::Resolve => &[0, 2],
                        FormKind::Bulk { .. } => &[2],
                        FormKind::Resolve { .. } => {
                            if f.choice == Some(0) {
                                &[0, 1, 2]
                            } else {
                                &[0, 2]
                            }
                        }
                    };
                    let pos = fields.iter().position(|x| *x == f.field).unwrap_or(0);
                    match action {
                        Action::NextField => f.field = fields[(pos + 1) % fields.len()],
                        Action::PrevField => f.field = fields[(pos + fields.len() - 1) % fields.len()],
                        // The choices do not wrap: ← stops at succeeded, → at compensated.
                        Action::ChoiceLeft if f.field == 0 => {
                            f.choice = Some(f.choice.map_or(0, |c| c.saturating_sub(1)));
                        }
                        Action::ChoiceRight if f.field == 0 => {
                            f.choice = Some(f.choice.map_or(0, |c| (c + 1).min(2)));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }

    fn on_submit(&mut self) -> Option<Request> {
        match self.mode {
            Mode::Command => self.submit_command(),
            Mode::Filter => {
                let text = self.filter.clone();
                match self.apply_filter(&text) {
                    Ok(()) => {
                        self.filter_before = None;
                        Some(self.fetch())
                    }
                    Err(e) => {
                        // Stays in the filter line, with what was not understood.
                        self.mode = Mode::Filter;
                        self.say(e, true);
                        None
                    }
                }
            }
            Mode::Confirm => {
                let c = self.dialog.confirm.take()?;
                // A lab switch was asked from the lab panel: back to it.
                self.mode = if matches!(c.request, Request::SetLab(_)) { Mode::Lab } else { self.dialog.return_to };
                if c.on_confirm {
                    self.say(format!("{}: sent", c.title), false);
                    if let Request::Bulk { action, targets } = &c.request {
                        self.bulk =
                            Some(BulkProgress { verb: action.verb().to_string(), done: 0, total: targets.len() });
                    }
                    Some(c.request)
                } else {
                    self.say("went back: nothing was done", false);
                    None
                }
            }
            Mode::Form => {
                let f = self.dialog.form.clone()?;
                if matches!(f.kind, FormKind::Resolve { .. }) && f.choice.is_none() {
                    if let Some(form) = self.dialog.form.as_mut() {
                        form.error = Some("choose a decision with ←/→ first".into());
                        form.field = 0;
                    }
                    return None;
                }
                if f.note.trim().is_empty() {
                    if let Some(form) = self.dialog.form.as_mut() {
                        form.error = Some("a note is required".into());
                        form.field = 2;
                    }
                    return None;
                }
                if let Some(c) = Self::confirm_cancel(&f) {
                    self.dialog.form = None;
                    self.dialog.confirm = Some(c);
                    self.mode = Mode::Confirm;
                    return None;
                }
                match self.bulk_form_confirm(&f) {
                    Ok(Some(c)) => {
                        self.dialog.form = None;
                        self.dialog.confirm = Some(c);
                        self.mode = Mode::Confirm;
                        return None;
                    }
                    Err((e, field)) => {
                        if let Some(form) = self.dialog.form.as_mut() {
                            form.error = Some(e);
                            form.field = field;
                        }
                        return None;
                    }
                    Ok(None) => {}
                }
                let (title, evidence, request) = match &f.kind {
                    FormKind::Cancel { .. } | FormKind::Bulk { .. } => return None,
                    FormKind::Deny { approval_id, evidence } => (
                        "Deny approval".to_string(),
                        evidence.iter().cloned().chain([format!("note        {}", f.note)]).collect(),
                        Request::Deny { approval_id: approval_id.clone(), note: f.note.clone() },
                    ),
                    FormKind::Resolve { operation_id, seen_version, last_query, unaskable, terms, found } => {
                        let Some(choice) = f.choice else {
                            if let Some(form) = self.dialog.form.as_mut() {
                                form.error = Some("choose a decision with ←/→ first".into());
                                form.field = 0;
                            }
                            return None;
                        };
                        let resolution = [Resolution::Succeeded, Resolution::Failed, Resolution::Compensated][choice];
                        let evidence = (choice == 0).then(|| f.evidence.trim().to_string());
                        if evidence.as_deref().is_some_and(str::is_empty) {
                            if let Some(form) = self.dialog.form.as_mut() {
                                form.error = Some("succeeded needs a receipt id as evidence".into());
                                form.field = 1;
                            }
                            return None;
                        }
                        let no_evidence = *unaskable && resolution == Resolution::Failed;
                        let evidence_line = if no_evidence {
                            "none either way: this tool's downstream cannot be asked; confirming states that".into()
                        } else {
                            evidence.clone().unwrap_or_else(|| "-".into())
                        };
                        let mut lines = vec![
                            format!("operation   {operation_id} (version {seen_version})"),
                            format!("resolve as  {}", resolution.as_str()),
                            format!("evidence    {evidence_line}"),
                            format!("last query  {last_query}"),
                        ];
                        lines.extend(terms.iter().map(|t| format!("amount      {t}")));
                        lines.extend(found.iter().map(|r| format!("found       {r}")));
                        lines.push(format!("note        {}", f.note));
                        (
                            "Resolve operation".to_string(),
                            lines,
                            Request::Resolve {
                                operation_id: operation_id.clone(),
                                resolution,
                                note: f.note.clone(),
                                evidence,
                                seen_version: *seen_version,
                                no_evidence,
                                against_evidence: false,
                            },
                        )
                    }
                };
                self.dialog.form = None;
                self.dialog.confirm = Some(Confirm { title, evidence, request, on_confirm: false });
                self.mode = Mode::Confirm;
                None
            }
            _ => None,
        }
    }
}

/// A stable key for row `i` (to keep the selection when rows move).
fn row_key(rows: &Rows, i: usize) -> Option<String> {
    match rows {
        Rows::Live(r) => r.get(i).map(|x| x.operation_id.clone()),
        Rows::Ops(r) => r.get(i).map(|x| x.id.clone()),
        Rows::Approvals(r) => r.get(i).map(|x| x.id.clone()),
        Rows::Audit(r) => r.get(i).map(|x| x.seq.to_string()),
        Rows::Metrics(_) | Rows::Empty => None,
    }
}

/// Applies an envelope to a one-line summary for the status bar.
pub fn summarize(env: &Envelope) -> (bool, String) {
    let m = &env.model_result;
    let exec = serde_json::to_value(m.execution).unwrap_or_default();
    let status = serde_json::to_value(m.status).unwrap_or_default();
    let mut s = format!(
        "{} · {} · {}",
        status.as_str().unwrap_or("?"),
        exec["outcome"].as_str().unwrap_or("?"),
        exec["delivery"].as_str().unwrap_or("?")
    );
    if let Some(e) = &m.error {
        s = format!("{} · {s}", e.code);
        // The refusal's reason, when the engine gave one (e.g. an approver not on
        // the tenant's allowlist): an operator needs the why, not only the code.
        if let Some(why) =
            e.detail.as_ref().and_then(|d| d.get("reason").or_else(|| d.get("rule"))).and_then(|v| v.as_str())
        {
            s = format!("{s} · {why}");
        }
    }
    (m.error.is_none(), s)
}
