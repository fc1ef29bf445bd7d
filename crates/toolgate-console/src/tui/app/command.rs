//! The command bar (`:`, as in k9s and vim): model state only. What was typed,
//! the history (Up / Down), Tab completion of command and pane names, the error
//! line, and the parse of a line into a [`Command`]. `App` runs the command;
//! the footer draws the bar. The help overlay lists [`COMMANDS`], so what `?`
//! shows is what the parser accepts.

use super::{App, Mode, Pane, Request};
use crate::tui::format::short;

/// One command, as the help overlay lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandSpec {
    /// The name typed after `:`.
    pub name: &'static str,
    /// Its arguments, as shown in help.
    pub args: &'static str,
    /// What it does.
    pub help: &'static str,
}

/// Every command the bar accepts, in the order help lists them.
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "live", args: "", help: "switch to the Live pane" },
    CommandSpec { name: "ledger", args: "", help: "switch to the Ledger pane" },
    CommandSpec { name: "approvals", args: "", help: "switch to the Approvals pane" },
    CommandSpec { name: "unknown", args: "", help: "switch to the Unknown pane" },
    CommandSpec { name: "audit", args: "", help: "switch to the Audit pane (operator log)" },
    CommandSpec { name: "walkthrough", args: "", help: "switch to the Walkthrough pane" },
    CommandSpec { name: "metrics", args: "", help: "switch to the Metrics pane" },
    CommandSpec {
        name: "op",
        args: "ID-OR-PREFIX",
        help: "open an operation's detail (an ambiguous prefix lists the matches)",
    },
    CommandSpec { name: "key", args: "KEY --tenant T", help: "find operations by idempotency key within a tenant" },
    CommandSpec {
        name: "sort",
        args: "COLUMN [asc|desc]",
        help: "order this pane by a column (Tab completes its columns; s and S too)",
    },
    CommandSpec {
        name: "filter",
        args: "EXPR",
        help: "filter this pane (as /): tenant:T subject:S tool:X state:S1,S2 id:PREFIX age:>5m needs:review|query, bare words match ids; empty clears",
    },
    CommandSpec { name: "filter", args: "save NAME", help: "save this pane's filter under a name (kept across restarts)" },
    CommandSpec { name: "filter", args: "NAME", help: "apply a saved filter" },
    CommandSpec {
        name: "operator",
        args: "NAME",
        help: "act as NAME from now on (approvals, decisions and the operator log use it)",
    },
    CommandSpec { name: "messages", args: "", help: "every status message of this session, newest first" },
    CommandSpec { name: "help", args: "", help: "keys and commands" },
    CommandSpec { name: "q", args: "", help: "quit" },
];

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Switch pane.
    Pane(Pane),
    /// Open the operation with this id, or this id prefix.
    Op(String),
    /// Operations whose idempotency key is this, within a tenant.
    Key {
        /// The caller's idempotency key.
        key: String,
        /// Tenant.
        tenant: String,
    },
    /// Order the pane by a column, ascending unless `desc` says otherwise.
    Sort {
        /// Column name.
        column: String,
        /// `Some(true)` for desc, `Some(false)` for asc.
        desc: Option<bool>,
    },
    /// Set (or, empty, clear) the pane's filter, or recall a saved one by name.
    Filter(String),
    /// Save the pane's filter under a name.
    SaveFilter(String),
    /// The help overlay.
    Help,
    /// The message log.
    Messages,
    /// Act as this operator from now on.
    Operator(String),
    /// Leave the console.
    Quit,
}

/// Longest command line kept (ids and keys are far shorter).
pub const MAX_LINE: usize = 300;
/// Entries kept in the history.
const HISTORY: usize = 50;

fn pane_named(name: &str) -> Option<Pane> {
    Pane::ALL.into_iter().find(|p| p.title().eq_ignore_ascii_case(name))
}

/// Parses a command line (without the `:`); the error says what was not understood.
pub fn parse(line: &str) -> Result<Command, String> {
    let line = line.trim();
    let (name, rest) = line.split_once(char::is_whitespace).map_or((line, ""), |(n, r)| (n, r.trim()));
    let name = name.strip_prefix(':').unwrap_or(name);
    if name.is_empty() {
        return Err("type a command; Tab completes, ? lists them".into());
    }
    let no_args = |c: Command| {
        if rest.is_empty() {
            Ok(c)
        } else {
            Err(format!(":{name} takes no arguments (got {:?})", short(rest, 30)))
        }
    };
    if let Some(p) = pane_named(name) {
        return no_args(Command::Pane(p));
    }
    match name {
        "q" | "quit" => no_args(Command::Quit),
        "help" => no_args(Command::Help),
        "messages" => no_args(Command::Messages),
        "operator" => {
            if rest.is_empty() {
                return Err(":operator needs a name: :operator NAME".into());
            }
            crate::engine::check_name("the operator name", rest, crate::engine::MAX_NAME_CHARS)
                .map(|()| Command::Operator(rest.to_string()))
                .map_err(|e| short(&e, 120))
        }
        "op" => {
            let mut words = rest.split_whitespace();
            match (words.next(), words.next()) {
                (None, _) => Err(":op needs an operation id or the start of one".into()),
                (Some(_), Some(_)) => Err(":op takes one id or prefix".into()),
                (Some(id), None) => Ok(Command::Op(id.to_string())),
            }
        }
        "key" => parse_key(rest),
        "sort" => {
            let words: Vec<&str> = rest.split_whitespace().collect();
            if words.len() > 2 {
                return Err(":sort takes a column and asc or desc".into());
            }
            let desc = match words.get(1).map(|w| w.to_ascii_lowercase()) {
                None => None,
                Some(w) if w == "asc" => Some(false),
                Some(w) if w == "desc" => Some(true),
                Some(w) => return Err(format!(":sort takes asc or desc after the column, not {:?}", short(&w, 20))),
            };
            match words.as_slice() {
                [] => Err(":sort needs a column (Tab lists this pane's)".into()),
                [c, ..] => Ok(Command::Sort { column: (*c).to_string(), desc }),
            }
        }
        "filter" => match rest.split_once(char::is_whitespace).map_or((rest, ""), |(a, b)| (a, b.trim())) {
            ("save", "") => Err(":filter save needs a name: :filter save NAME".into()),
            ("save", name) => {
                if name.len() <= 32 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                    Ok(Command::SaveFilter(name.to_string()))
                } else {
                    Err(format!("a filter name is up to 32 letters, digits, - or _ (not {:?})", short(name, 40)))
                }
            }
            _ => Ok(Command::Filter(rest.to_string())),
        },
        _ => {
            let near: Vec<&str> = COMMANDS.iter().map(|c| c.name).filter(|c| c.starts_with(name)).collect();
            let hint = if near.is_empty() { String::new() } else { format!(" (did you mean :{}?)", near.join(", :")) };
            Err(format!("unknown command :{}{hint}; ? lists the commands", short(name, 30)))
        }
    }
}

fn parse_key(rest: &str) -> Result<Command, String> {
    let mut key = None;
    let mut tenant = None;
    let mut words = rest.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--tenant" {
            let Some(t) = words.next() else { return Err("--tenant needs a tenant".into()) };
            tenant = Some(t.to_string());
        } else if w.starts_with("--") {
            return Err(format!(":key does not know {} (only --tenant T)", short(w, 20)));
        } else if key.replace(w.to_string()).is_some() {
            return Err(":key takes one key (keys have no spaces)".into());
        }
    }
    match (key, tenant) {
        (Some(key), Some(tenant)) => Ok(Command::Key { key, tenant }),
        (None, _) => Err(":key needs a key: :key KEY --tenant T".into()),
        (Some(_), None) => Err(":key needs the tenant: :key KEY --tenant T".into()),
    }
}

/// The command bar's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandBar {
    /// What is typed (without the `:`).
    pub input: String,
    /// Earlier lines, oldest first.
    pub history: Vec<String>,
    /// While browsing the history: the entry shown, and the line typed before.
    browsing: Option<(usize, String)>,
    /// The error line (an unknown command, a bad argument, no match).
    pub error: Option<String>,
    /// Candidates listed under the bar: completions, or the operations an
    /// ambiguous prefix matched.
    pub candidates: Vec<String>,
    /// More candidates exist than are listed.
    pub more: bool,
    /// The mode to return to when a command leaves the bar without switching.
    pub return_to: Mode,
}

impl CommandBar {
    /// Opens an empty bar (the history stays).
    pub fn open(&mut self) {
        self.input.clear();
        self.browsing = None;
        self.error = None;
        self.candidates.clear();
        self.more = false;
    }

    /// A typed character.
    pub fn push(&mut self, c: char) {
        if self.input.chars().count() < MAX_LINE && !c.is_control() {
            self.input.push(c);
            self.browsing = None;
            self.error = None;
        }
    }

    /// Backspace.
    pub fn pop(&mut self) {
        self.input.pop();
        self.browsing = None;
        self.error = None;
    }

    /// Takes the line for running it, and keeps it in the history.
    pub fn take(&mut self) -> String {
        let line = std::mem::take(&mut self.input).trim().to_string();
        self.browsing = None;
        self.candidates.clear();
        self.more = false;
        if !line.is_empty() && self.history.last() != Some(&line) {
            self.history.push(line.clone());
            if self.history.len() > HISTORY {
                self.history.remove(0);
            }
        }
        line
    }

    /// Up: the previous history entry (the typed line is kept for Down).
    pub fn older(&mut self) {
        let i = match &self.browsing {
            None if self.history.is_empty() => return,
            None => {
                self.browsing = Some((self.history.len() - 1, self.input.clone()));
                self.history.len() - 1
            }
            Some((i, draft)) => {
                let i = i.saturating_sub(1);
                self.browsing = Some((i, draft.clone()));
                i
            }
        };
        self.input.clone_from(&self.history[i]);
    }

    /// Down: the next history entry, then back to the line being typed.
    pub fn newer(&mut self) {
        let Some((i, draft)) = self.browsing.take() else { return };
        if i + 1 < self.history.len() {
            self.input.clone_from(&self.history[i + 1]);
            self.browsing = Some((i + 1, draft));
        } else {
            self.input = draft;
        }
    }

    /// Tab: completes the command name, a pane name, or the operation id among
    /// the listed candidates; several matches are completed to what they share
    /// and listed.
    /// `sort_columns` are the current pane's (completed after `sort `).
    /// `filter_names` are the saved filters (completed after `filter `).
    pub fn complete(&mut self, sort_columns: &[&str], filter_names: &[String]) {
        self.error = None;
        let (word, head) = match self.input.rsplit_once(' ') {
            Some((h, w)) => (w.to_string(), format!("{h} ")),
            None => (self.input.clone(), String::new()),
        };
        let pool: Vec<String> = if head.is_empty() {
            let mut names: Vec<String> = COMMANDS.iter().map(|c| c.name.to_string()).collect();
            names.dedup();
            names
        } else if head.trim() == "op" {
            self.candidates.clone()
        } else if head.trim() == "sort" {
            sort_columns.iter().map(|c| (*c).to_string()).collect()
        } else if head.trim() == "filter" {
            // Saved names, then the fields an expression can name.
            let mut pool: Vec<String> = filter_names.to_vec();
            pool.extend(super::filter::FIELDS.iter().map(|f| format!("{f}:")));
            pool.push("save".into());
            pool
        } else {
            Vec::new()
        };
        // Among the operations an ambiguous `:op` listed, Tab on a whole id
        // goes to the next one (Shift-less cycling, as a shell menu does).
        if head.trim() == "op" {
            if let Some(i) = self.candidates.iter().position(|c| *c == word) {
                let next = &self.candidates[(i + 1) % self.candidates.len()];
                self.input = format!("{head}{next}");
                return;
            }
        }
        let hits: Vec<String> = pool.into_iter().filter(|c| c.starts_with(&word)).collect();
        match hits.as_slice() {
            [] => {
                self.error = Some(format!("nothing to complete for {:?}", short(&word, 30)));
            }
            [one] => {
                self.input = format!("{head}{one}");
                if head.is_empty() && COMMANDS.iter().any(|c| c.name == one && !c.args.is_empty()) {
                    self.input.push(' ');
                }
                // The listed operations stay: Tab cycles among them.
                if !head.is_empty() && head.trim() != "op" {
                    self.candidates.clear();
                }
            }
            many => {
                let common = common_prefix(many);
                // Nothing more in common: the first match, and Tab cycles on.
                let common = if head.trim() == "op" && common == word { many[0].clone() } else { common };
                self.input = format!("{head}{common}");
                if head.is_empty() || head.trim() == "sort" || head.trim() == "filter" {
                    self.candidates = many.to_vec();
                    self.more = false;
                }
            }
        }
    }
}

fn common_prefix(words: &[String]) -> String {
    let Some(first) = words.first() else { return String::new() };
    let mut n = first.len();
    for w in &words[1..] {
        n = first.char_indices().zip(w.chars()).take_while(|((_, a), b)| a == b).count().min(n);
    }
    first.chars().take(n).collect()
}

/// Operations an `:op` prefix lists at most (one more is fetched to know there are more).
pub const MATCHES_SHOWN: usize = 8;

impl App {
    /// `:` opens the bar.
    pub(super) fn start_command(&mut self) -> Option<Request> {
        self.command.open();
        self.command.return_to = if self.mode == Mode::Detail { Mode::Detail } else { Mode::Normal };
        self.mode = Mode::Command;
        None
    }

    /// Enter: parses and runs the line; an error keeps the bar open with the line.
    pub(super) fn submit_command(&mut self) -> Option<Request> {
        let line = self.command.take();
        match parse(&line) {
            Err(e) => {
                self.command.input = line;
                self.command.error = Some(e);
                None
            }
            Ok(cmd) => {
                self.mode = self.command.return_to;
                self.run_command(cmd, &line)
            }
        }
    }

    /// Runs a parsed command; `line` is what was typed (put back in the bar,
    /// whole, when the command is refused).
    fn run_command(&mut self, cmd: Command, line: &str) -> Option<Request> {
        match cmd {
            Command::Quit => {
                self.quit = true;
                None
            }
            Command::Help => {
                self.help.return_to = Mode::Normal;
                self.help.scroll = 0;
                self.help.messages = false;
                self.mode = Mode::Help;
                None
            }
            Command::Messages => {
                self.help.return_to = Mode::Normal;
                self.help.messages = true;
                self.help.scroll = 0;
                self.mode = Mode::Help;
                None
            }
            Command::Pane(p) => {
                self.mode = Mode::Normal;
                self.switch_pane(p)
            }
            Command::Operator(name) => {
                if self.refuse_read_only() {
                    return None;
                }
                let was = std::mem::replace(&mut self.operator, name.clone());
                self.say(
                    format!(
                        "operator is now {} (was {}): approvals, decisions and the operator log use this name",
                        short(&name, 40),
                        short(&was, 40)
                    ),
                    false,
                );
                Some(Request::SetOperator(name))
            }
            Command::Filter(expr) => {
                // A saved name recalls its filter; anything else is an expression.
                let (text, named) = match self.saved_filters.get(expr.trim()) {
                    Some(saved) => (saved.clone(), Some(expr.trim().to_string())),
                    None => (expr.clone(), None),
                };
                match self.apply_filter(&text) {
                    Ok(()) => {
                        if let Some(name) = named {
                            self.say(format!("filter {name}: {}", short(&text, 60)), false);
                        }
                        Some(self.fetch())
                    }
                    Err(e) => {
                        self.command.input = line.to_string();
                        self.command.error = Some(e);
                        self.mode = Mode::Command;
                        None
                    }
                }
            }
            Command::SaveFilter(name) => {
                if self.filter.is_empty() {
                    self.say("this pane has no filter to save: set one with / or :filter EXPR first", true);
                } else {
                    self.saved_filters.insert(name.clone(), self.filter.clone());
                    self.prefs_dirty = true;
                    self.say(
                        format!("saved filter {name}: {} (recall with :filter {name})", short(&self.filter, 60)),
                        false,
                    );
                }
                None
            }
            Command::Sort { column, desc } => match self.sort_by(&column, desc) {
                Ok(r) => Some(r),
                Err(e) => {
                    self.command.input = line.to_string();
                    self.command.error = Some(e);
                    self.mode = Mode::Command;
                    None
                }
            },
            Command::Op(prefix) => {
                self.say(format!("looking for {}…", short(&prefix, 40)), false);
                Some(Request::FindOperation { prefix, limit: MATCHES_SHOWN as i64 + 1 })
            }
            Command::Key { key, tenant } => {
                // The key is not echoed: screens show keys only as digests.
                self.say(format!("looking for that key in {}…", short(&tenant, 20)), false);
                Some(Request::FindByKey { key, tenant, limit: MATCHES_SHOWN as i64 + 1 })
            }
        }
    }

    /// The operations a `:op` or `:key` lookup found: one opens its detail,
    /// several are listed under the bar (Tab completes among them), none is an error.
    /// `asked` names the lookup for people; `prefix` is the `:op` argument, put
    /// back in the bar when several operations match it.
    pub(super) fn on_found(&mut self, asked: &str, prefix: Option<&str>, mut ids: Vec<String>) -> Option<Request> {
        match ids.len() {
            0 => {
                self.say(format!("no operation matches {}", short(asked, 60)), true);
                None
            }
            1 => {
                let id = ids.remove(0);
                self.status = None;
                self.mode = Mode::Detail;
                self.detail.open_operation();
                Some(Request::Detail(id))
            }
            n => {
                let more = n > MATCHES_SHOWN;
                ids.truncate(MATCHES_SHOWN);
                self.command.open();
                if let Some(p) = prefix {
                    self.command.input = format!("op {p}");
                }
                self.command.error = Some(format!(
                    "{} matches {}{} operations: type more of the id (Tab completes) or Esc",
                    short(asked, 40),
                    if more { "more than " } else { "" },
                    ids.len()
                ));
                self.command.candidates = ids;
                self.command.more = more;
                self.mode = Mode::Command;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(line: &str, expect: &Result<Command, &str>) {
        let got = parse(line);
        match (&got, expect) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{line}"),
            (Err(a), Err(b)) => assert!(a.contains(b), "{line}: {a:?} should contain {b:?}"),
            _ => panic!("{line}: got {got:?}, expected {expect:?}"),
        }
    }

    #[test]
    fn lines_parse_into_commands_or_say_what_was_not_understood() {
        check("live", &Ok(Command::Pane(Pane::Live)));
        check(" Unknown ", &Ok(Command::Pane(Pane::Unknown)));
        check(":metrics", &Ok(Command::Pane(Pane::Metrics)));
        check("op op_6469", &Ok(Command::Op("op_6469".into())));
        check("key refund-1 --tenant acme", &Ok(Command::Key { key: "refund-1".into(), tenant: "acme".into() }));
        check("key --tenant acme refund-1", &Ok(Command::Key { key: "refund-1".into(), tenant: "acme".into() }));
        check("filter tenant:acme", &Ok(Command::Filter("tenant:acme".into())));
        check("sort since", &Ok(Command::Sort { column: "since".into(), desc: None }));
        check("sort tool DESC", &Ok(Command::Sort { column: "tool".into(), desc: Some(true) }));
        check("sort tool asc", &Ok(Command::Sort { column: "tool".into(), desc: Some(false) }));
        check("sort", &Err("needs a column"));
        check("sort tool up", &Err("asc or desc"));
        check("sort a b c", &Err("a column and asc or desc"));
        check("filter", &Ok(Command::Filter(String::new())));
        check("filter save stuck", &Ok(Command::SaveFilter("stuck".into())));
        check("filter save", &Err("needs a name"));
        check("filter save a/b", &Err("a filter name is up to 32"));
        check("filter saved:x", &Ok(Command::Filter("saved:x".into())));
        check("q", &Ok(Command::Quit));
        check("help", &Ok(Command::Help));
        check("operator dana", &Ok(Command::Operator("dana".into())));
        check("operator  Dana Scully ", &Ok(Command::Operator("Dana Scully".into())));
        check("operator", &Err("needs a name"));
        check("operator a\u{1b}b", &Err("control characters"));
        check("", &Err("type a command"));
        check("op", &Err(":op needs an operation id"));
        check("op a b", &Err("one id"));
        check("key refund-1", &Err("needs the tenant"));
        check("key --tenant", &Err("--tenant needs a tenant"));
        check("key a b --tenant t", &Err("one key"));
        check("key a --bogus", &Err("does not know --bogus"));
        check("ledger now", &Err("takes no arguments"));
        check("frobnicate", &Err("unknown command :frobnicate"));
        check("a", &Err("did you mean :approvals, :audit?"));
        check("\u{1b}[2J", &Err("\\u{1b}"));
    }

    fn bar(input: &str) -> CommandBar {
        let mut b = CommandBar::default();
        for c in input.chars() {
            b.push(c);
        }
        b
    }

    #[test]
    fn tab_completes_names_and_lists_what_several_share() {
        let mut b = bar("li");
        b.complete(&[], &[]);
        assert_eq!(b.input, "live");
        let mut b = bar("a");
        b.complete(&[], &[]);
        assert_eq!((b.input.as_str(), b.candidates.clone()), ("a", vec!["approvals".to_string(), "audit".into()]));
        let mut b = bar("ope");
        b.complete(&[], &[]);
        assert_eq!(b.input, "operator ", "a command with arguments gets its space");
        let mut b = bar("op");
        b.complete(&[], &[]);
        assert_eq!(b.candidates, vec!["op".to_string(), "operator".into()]);
        let mut b = bar("zz");
        b.complete(&[], &[]);
        assert!(b.error.as_deref().is_some_and(|e| e.contains("nothing to complete")));
        // An ambiguous :op listed its matches: Tab completes among them.
        let mut b = bar("op op_6");
        b.candidates = vec!["op_64a1".into(), "op_64b1".into()];
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_64");
        b.push('b');
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_64b1");
        // Tab on a whole listed id goes to the next one (issue 32 §2).
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_64a1");
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_64b1");
        let mut b = bar("op op_");
        b.candidates = vec!["op_1a".into(), "op_2b".into(), "op_3c".into()];
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_1a", "nothing more in common: the first");
        b.complete(&[], &[]);
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_3c");
        b.complete(&[], &[]);
        assert_eq!(b.input, "op op_1a");
        // After `sort `, the pane's columns.
        let mut b = bar("sort s");
        b.complete(&["since", "state", "tool"], &[]);
        assert_eq!((b.input.as_str(), b.candidates.len()), ("sort s", 2));
        b.push('i');
        b.complete(&["since", "state", "tool"], &[]);
        assert_eq!(b.input, "sort since");
    }

    #[test]
    fn history_walks_back_and_returns_to_the_line_being_typed() {
        let mut b = CommandBar::default();
        for line in ["ledger", "op op_1", "op op_1", "unknown"] {
            for c in line.chars() {
                b.push(c);
            }
            b.take();
        }
        assert_eq!(b.history, vec!["ledger", "op op_1", "unknown"], "a repeat is kept once");
        b.push('m');
        b.older();
        assert_eq!(b.input, "unknown");
        b.older();
        b.older();
        b.older();
        assert_eq!(b.input, "ledger", "stops at the oldest");
        b.newer();
        assert_eq!(b.input, "op op_1");
        b.newer();
        b.newer();
        assert_eq!(b.input, "m", "back to what was typed");
        b.newer();
        assert_eq!(b.input, "m");
        let mut empty = CommandBar::default();
        empty.older();
        assert_eq!(empty.input, "");
    }

    #[test]
    fn the_line_is_bounded_and_control_characters_are_not_typed() {
        let mut b = CommandBar::default();
        for _ in 0..MAX_LINE + 10 {
            b.push('x');
        }
        b.push('\u{7}');
        assert_eq!(b.input.chars().count(), MAX_LINE);
    }
}
