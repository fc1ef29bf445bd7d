//! What the console keeps across restarts (model state): each pane's last
//! filter and sort, and the named filters. The event loop reads and writes
//! them as a small JSON file under the config directory (`tui::config`);
//! here they are plain data, checked when restored: a filter that no longer
//! parses or a column that no longer exists is left out and said.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{filter, sort, App, Pane};
use crate::store::Order;

/// One pane's remembered view.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PanePrefs {
    /// Filter expression (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub filter: String,
    /// Sort column name (absent: the pane's default order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sort: Option<String>,
    /// Descending.
    #[serde(default)]
    pub desc: bool,
}

/// The console's remembered settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prefs {
    /// Per pane, by lower-case title (`unknown`).
    #[serde(default)]
    pub panes: BTreeMap<String, PanePrefs>,
    /// Named filters.
    #[serde(default)]
    pub filters: BTreeMap<String, String>,
}

fn key(p: Pane) -> String {
    p.title().to_ascii_lowercase()
}

impl App {
    /// The settings to save now.
    pub fn prefs(&self) -> Prefs {
        let mut panes = BTreeMap::new();
        for p in Pane::ALL {
            let filter =
                if p == self.pane { self.filter.clone() } else { self.filters.get(&p).cloned().unwrap_or_default() };
            let (sort, desc) = match self.sorts.get(&p) {
                Some(o) => (sort::columns(p).get(o.column).map(|c| (*c).to_string()), o.desc),
                None => (None, false),
            };
            if !filter.is_empty() || sort.is_some() {
                panes.insert(key(p), PanePrefs { filter, sort, desc });
            }
        }
        Prefs { panes, filters: self.saved_filters.clone() }
    }

    /// Restores saved settings; returns what was left out and why (empty: all of it).
    /// The caller fetches the current pane afterwards.
    pub fn restore(&mut self, prefs: &Prefs) -> Vec<String> {
        let mut dropped = Vec::new();
        for (name, pp) in &prefs.panes {
            let Some(p) = Pane::ALL.into_iter().find(|p| key(*p) == *name) else {
                dropped.push(format!("no pane {name:?}"));
                continue;
            };
            if !pp.filter.is_empty() {
                match filter::parse_for(&pp.filter, p) {
                    Ok(_) if p == self.pane => self.filter.clone_from(&pp.filter),
                    Ok(_) => {
                        self.filters.insert(p, pp.filter.clone());
                    }
                    Err(e) => dropped.push(format!("{name} filter: {e}")),
                }
            }
            if let Some(col) = &pp.sort {
                match sort::columns(p).iter().position(|c| c == col) {
                    Some(column) => {
                        self.sorts.insert(p, Order { column, desc: pp.desc });
                    }
                    None => dropped.push(format!("{name} has no column {col:?} to sort by")),
                }
            }
        }
        for (name, expr) in &prefs.filters {
            match filter::parse(expr) {
                Ok(_) => {
                    self.saved_filters.insert(name.clone(), expr.clone());
                }
                Err(e) => dropped.push(format!("filter {name}: {e}")),
            }
        }
        dropped
    }

    /// Says how loading the settings went (the event loop loads them).
    pub fn said_prefs(&mut self, text: impl Into<String>, error: bool) {
        self.say(text, error);
    }
}
