//! Keymaps per mode. The help overlay is generated from these tables, so what
//! `?` shows is exactly what the keys do.

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use super::app::{Action, Mode, Pane};

/// One binding.
#[derive(Debug, Clone)]
pub struct Binding {
    /// Keys as shown in help.
    pub keys: &'static str,
    /// What it does.
    pub help: &'static str,
    /// Changes the ledger (hidden and refused in read-only mode).
    pub changes_state: bool,
    matches: fn(&KeyEvent) -> Option<Action>,
}

fn ch(k: &KeyEvent, c: char) -> bool {
    k.code == KeyCode::Char(c) && !k.modifiers.contains(KeyModifiers::CONTROL)
}

fn ctrl_c(k: &KeyEvent) -> bool {
    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL)
}

macro_rules! bind {
    ($keys:expr, $help:expr, $state:expr, $f:expr) => {
        Binding { keys: $keys, help: $help, changes_state: $state, matches: $f }
    };
}

/// `j k / Down Up`: the panes move the selection, the detail scrolls.
fn up_down(k: &KeyEvent) -> Option<Action> {
    match k.code {
        KeyCode::Down => Some(Action::Down),
        KeyCode::Up => Some(Action::Up),
        _ if ch(k, 'j') => Some(Action::Down),
        _ if ch(k, 'k') => Some(Action::Up),
        _ => None,
    }
}

/// `PgDn PgUp / Ctrl-F Ctrl-B`: a pane's next page, a page of the detail.
fn paging(k: &KeyEvent) -> Option<Action> {
    match k.code {
        KeyCode::PageDown => Some(Action::PageDown),
        KeyCode::PageUp => Some(Action::PageUp),
        KeyCode::Char('f') if k.modifiers.contains(KeyModifiers::CONTROL) => Some(Action::PageDown),
        KeyCode::Char('b') if k.modifiers.contains(KeyModifiers::CONTROL) => Some(Action::PageUp),
        _ => None,
    }
}

/// `g G / Home End`: the first and last row, the top and end of the detail.
fn ends(k: &KeyEvent) -> Option<Action> {
    match k.code {
        KeyCode::Home => Some(Action::Top),
        KeyCode::End => Some(Action::Bottom),
        _ if ch(k, 'g') => Some(Action::Top),
        _ if ch(k, 'G') => Some(Action::Bottom),
        _ => None,
    }
}

/// Keys that work in every mode.
fn global() -> Vec<Binding> {
    vec![bind!("Ctrl-C", "quit", false, |k| ctrl_c(k).then_some(Action::Quit))]
}

/// Normal-mode bindings (browsing panes).
pub fn normal() -> Vec<Binding> {
    vec![
        // The label names every pane of `Pane::ALL` in order (a test checks).
        bind!("1-7", "switch pane (Live, Ledger, Approvals, Unknown, Audit, Walkthrough, Metrics)", false, |k| match k
            .code
        {
            KeyCode::Char(c) if !k.modifiers.contains(KeyModifiers::CONTROL) => Pane::of_key(c).map(Action::SelectPane),
            _ => None,
        }),
        bind!("Tab / Shift-Tab", "next / previous pane", false, |k| match k.code {
            KeyCode::Tab => Some(Action::NextPane),
            KeyCode::BackTab => Some(Action::PrevPane),
            _ => None,
        }),
        bind!("j k / Down Up", "move the selection (the walkthrough: scroll its steps)", false, up_down),
        bind!("PgDn PgUp / Ctrl-F Ctrl-B", "next / previous page (keyset paging)", false, paging),
        bind!("g G / Home End", "first / last row (the walkthrough: first / newest step)", false, ends),
        bind!("Enter", "detail: record, bindings, trace timeline, operator log", false, |k| {
            (k.code == KeyCode::Enter).then_some(Action::OpenDetail)
        }),
        bind!("v", "mark / unmark the selected row; with marks, q a d r c act on every marked row", false, |k| ch(
            k, 'v'
        )
        .then_some(Action::ToggleMark)),
        bind!("V", "mark every row that matches this pane's filter (not only this page)", false, |k| ch(k, 'V')
            .then_some(Action::MarkAll)),
        bind!("q", "status query on the selected unknown operation", true, |k| ch(k, 'q').then_some(Action::AskQuery)),
        bind!("a", "approve the selected request", true, |k| ch(k, 'a').then_some(Action::AskApprove)),
        bind!("d", "deny the selected request (note)", true, |k| ch(k, 'd').then_some(Action::AskDeny)),
        bind!("r", "resolve the selected operation (succeeded / failed / compensated)", true, |k| {
            ch(k, 'r').then_some(Action::AskResolve)
        }),
        bind!("c", "cancel the selected accepted / in-flight operation", true, |k| {
            ch(k, 'c').then_some(Action::AskCancel)
        }),
        bind!("f", "simulated agents' fault rate (0, 1, 5, 20, 100%)", true, |k| {
            ch(k, 'f').then_some(Action::CycleFaults)
        }),
        bind!("L", "lab panel: defenses off (demo databases only)", false, |k| {
            ch(k, 'L').then_some(Action::OpenLab)
        }),
        bind!("n", "walkthrough: run the next step", false, |k| ch(k, 'n').then_some(Action::ScenarioNext)),
        bind!("[ ]", "walkthrough: previous / next scenario", false, |k| {
            if ch(k, '[') {
                Some(Action::ScenarioPick(-1))
            } else if ch(k, ']') {
                Some(Action::ScenarioPick(1))
            } else {
                None
            }
        }),
        bind!("s", "sort by the next column (the header shows column and direction)", false, |k| {
            ch(k, 's').then_some(Action::CycleSort)
        }),
        bind!("S", "reverse the sort", false, |k| ch(k, 'S').then_some(Action::ReverseSort)),
        bind!("/", "filter: tenant:T tool:X state:S age:>5m needs:review, bare words match ids", false, |k| ch(k, '/')
            .then_some(Action::StartFilter)),
        bind!(":", "command bar (:op ID, :unknown, :filter EXPR, :q …; listed below)", false, |k| ch(k, ':')
            .then_some(Action::StartCommand)),
        bind!("y", "copy the selected id (OSC 52)", false, |k| ch(k, 'y').then_some(Action::Copy)),
        bind!("space", "pause / resume live refresh", false, |k| ch(k, ' ').then_some(Action::TogglePause)),
        bind!("?", "this help", false, |k| ch(k, '?').then_some(Action::ToggleHelp)),
        bind!("Esc", "back; clear the marks, then the filter", false, |k| (k.code == KeyCode::Esc)
            .then_some(Action::Back)),
        bind!("Q", "quit", false, |k| ch(k, 'Q').then_some(Action::Quit)),
    ]
}

fn detail() -> Vec<Binding> {
    vec![
        bind!("j k / Down Up", "scroll", false, up_down),
        bind!("g G / Home End", "to the top / the end", false, ends),
        bind!("PgDn PgUp / Ctrl-F Ctrl-B", "a page down / up", false, paging),
        bind!("Esc / Enter", "back", false, |k| matches!(k.code, KeyCode::Esc | KeyCode::Enter)
            .then_some(Action::Back)),
        bind!("F", "follow the trace: fetched again as events arrive, shown to its end (F or j/k stops)", false, |k| {
            ch(k, 'F').then_some(Action::ToggleFollow)
        }),
        bind!("q", "status query on this operation", true, |k| ch(k, 'q').then_some(Action::AskQuery)),
        bind!("a / d", "approve / deny this pending approval (its detail, from pane 3)", true, |k| {
            if ch(k, 'a') {
                Some(Action::AskApprove)
            } else if ch(k, 'd') {
                Some(Action::AskDeny)
            } else {
                None
            }
        }),
        bind!("r", "resolve this operation (unknown / needs_review)", true, |k| ch(k, 'r')
            .then_some(Action::AskResolve)),
        bind!("c", "cancel this operation (accepted / in-flight)", true, |k| ch(k, 'c').then_some(Action::AskCancel)),
        bind!("y", "copy the operation id", false, |k| ch(k, 'y').then_some(Action::Copy)),
        bind!(":", "command bar", false, |k| ch(k, ':').then_some(Action::StartCommand)),
        bind!("?", "help", false, |k| ch(k, '?').then_some(Action::ToggleHelp)),
        bind!("Q", "quit", false, |k| ch(k, 'Q').then_some(Action::Quit)),
    ]
}

fn text_entry() -> Vec<Binding> {
    vec![
        bind!("Enter", "apply / submit", false, |k| (k.code == KeyCode::Enter).then_some(Action::Submit)),
        bind!("Esc", "cancel", false, |k| (k.code == KeyCode::Esc).then_some(Action::Back)),
        bind!("Backspace", "delete", false, |k| (k.code == KeyCode::Backspace).then_some(Action::Backspace)),
        bind!("Tab / Shift-Tab", "next / previous field", false, |k| match k.code {
            KeyCode::Tab => Some(Action::NextField),
            KeyCode::BackTab => Some(Action::PrevField),
            _ => None,
        }),
        bind!("Left Right", "change the choice", false, |k| match k.code {
            KeyCode::Left => Some(Action::ChoiceLeft),
            KeyCode::Right => Some(Action::ChoiceRight),
            _ => None,
        }),
        bind!("any character", "type", false, |k| match k.code {
            KeyCode::Char(c) if !k.modifiers.contains(KeyModifiers::CONTROL) => Some(Action::Input(c)),
            _ => None,
        }),
    ]
}

fn command() -> Vec<Binding> {
    vec![
        bind!("Enter", "run the command", false, |k| (k.code == KeyCode::Enter).then_some(Action::Submit)),
        bind!("Esc", "close the command bar", false, |k| (k.code == KeyCode::Esc).then_some(Action::Back)),
        bind!("Tab", "complete a command, pane name or listed id", false, |k| (k.code == KeyCode::Tab)
            .then_some(Action::Complete)),
        bind!("Up Down", "command history", false, |k| match k.code {
            KeyCode::Up => Some(Action::HistoryPrev),
            KeyCode::Down => Some(Action::HistoryNext),
            _ => None,
        }),
        bind!("Backspace", "delete", false, |k| (k.code == KeyCode::Backspace).then_some(Action::Backspace)),
        bind!("any character", "type", false, |k| match k.code {
            KeyCode::Char(c) if !k.modifiers.contains(KeyModifiers::CONTROL) => Some(Action::Input(c)),
            _ => None,
        }),
    ]
}

fn confirm() -> Vec<Binding> {
    vec![
        bind!("Tab / Left Right / h l", "move between Cancel and Confirm (Cancel is the default)", false, |k| match k
            .code
        {
            KeyCode::Tab | KeyCode::BackTab | KeyCode::Left | KeyCode::Right => Some(Action::NextField),
            _ if ch(k, 'h') || ch(k, 'l') => Some(Action::NextField),
            _ => None,
        }),
        bind!("Enter", "choose the focused button", false, |k| (k.code == KeyCode::Enter).then_some(Action::Submit)),
        bind!("Esc / n", "cancel", false, |k| (k.code == KeyCode::Esc || ch(k, 'n')).then_some(Action::Back)),
    ]
}

fn lab() -> Vec<Binding> {
    vec![
        bind!("j k / Down Up", "choose a defense", false, up_down),
        bind!("Enter", "switch the chosen defense off (confirm)", true, |k| {
            (k.code == KeyCode::Enter).then_some(Action::Submit)
        }),
        bind!("o", "every defense back on", true, |k| ch(k, 'o').then_some(Action::LabAllOn)),
        bind!("f", "simulated agents' fault rate: next step", true, |k| ch(k, 'f').then_some(Action::CycleFaults)),
        bind!("Esc / L", "close the lab panel", false, |k| {
            (k.code == KeyCode::Esc || ch(k, 'L')).then_some(Action::Back)
        }),
        bind!("?", "help", false, |k| ch(k, '?').then_some(Action::ToggleHelp)),
        bind!("Q", "quit", false, |k| ch(k, 'Q').then_some(Action::Quit)),
    ]
}

fn help() -> Vec<Binding> {
    vec![
        bind!("? / Esc / Q", "close help", false, |k| {
            (ch(k, '?') || k.code == KeyCode::Esc || ch(k, 'Q')).then_some(Action::ToggleHelp)
        }),
        bind!("j k / Down Up", "scroll the help", false, up_down),
    ]
}

/// The bindings of a mode (without the global ones).
pub fn bindings(mode: Mode) -> Vec<Binding> {
    match mode {
        Mode::Normal => normal(),
        Mode::Detail => detail(),
        Mode::Filter | Mode::Form => text_entry(),
        Mode::Confirm => confirm(),
        Mode::Lab => lab(),
        Mode::Command => command(),
        // Any other key closes help and does what it does in the mode below.
        Mode::Help => help().into_iter().chain(normal()).collect(),
    }
}

/// Looks a key up in the current mode's keymap.
/// In read-only mode a state-changing key is not ignored: it becomes
/// [`Action::ReadOnly`], and the status line says why nothing happens.
pub fn lookup(mode: Mode, key: &KeyEvent, read_only: bool) -> Option<Action> {
    global().iter().chain(bindings(mode).iter()).find_map(|b| {
        let action = (b.matches)(key)?;
        Some(if read_only && b.changes_state { Action::ReadOnly(b.help) } else { action })
    })
}

/// Help lines for a mode: (keys, what), state-changing ones hidden in read-only.
pub fn help_lines(mode: Mode, read_only: bool) -> Vec<(&'static str, &'static str)> {
    bindings(mode)
        .into_iter()
        .chain(global())
        .filter(|b| !(read_only && b.changes_state))
        .map(|b| (b.keys, b.help))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pane_keys_and_their_help_follow_the_pane_table() {
        let (keys, help) =
            help_lines(Mode::Normal, false).into_iter().find(|(_, h)| h.starts_with("switch pane")).unwrap();
        assert_eq!(keys, format!("1-{}", Pane::ALL.len()), "the label names as many keys as there are panes");
        let titles: Vec<&str> = Pane::ALL.iter().map(|p| p.title()).collect();
        assert_eq!(help, format!("switch pane ({})", titles.join(", ")), "the help names every pane, in order");
        for (i, pane) in Pane::ALL.iter().enumerate() {
            let key = char::from_digit(u32::try_from(i + 1).unwrap(), 10).unwrap();
            let k = KeyEvent::new(KeyCode::Char(key), KeyModifiers::NONE);
            assert_eq!(lookup(Mode::Normal, &k, false), Some(Action::SelectPane(*pane)));
        }
        let past = char::from_digit(u32::try_from(Pane::ALL.len() + 1).unwrap(), 10).unwrap();
        assert_ne!(
            lookup(Mode::Normal, &KeyEvent::new(KeyCode::Char(past), KeyModifiers::NONE), false)
                .map(|a| matches!(a, Action::SelectPane(_))),
            Some(true)
        );
    }
}
