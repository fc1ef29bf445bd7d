//! Sorting the panes (model state): each pane's order, `s` (next column), `S`
//! (reverse), `:sort COLUMN [asc|desc]`, and the keyset cursor of the next page
//! in that order. The columns and their SQL live in the store
//! ([`crate::store::OPS_SORT`] and the like); a pane only names one.
//!
//! Default orders are the ones triage needs: Unknown oldest first (by its last
//! change, index-backed), Approvals soonest expiry first, Live soonest next
//! attempt first, Ledger and Audit newest first.

use super::{App, Pane, Request, Rows};
use crate::store::{cursor_after, Cursor, Key, Order, APPROVALS_SORT, AUDIT_SORT, LIVE_SORT, OPS_SORT};

/// The names of the columns a pane can be sorted by (empty: not a table).
pub fn columns(pane: Pane) -> Vec<&'static str> {
    match pane {
        Pane::Ledger | Pane::Unknown => OPS_SORT.iter().map(|c| c.name).collect(),
        Pane::Live => LIVE_SORT.iter().map(|c| c.name).collect(),
        Pane::Approvals => APPROVALS_SORT.iter().map(|c| c.name).collect(),
        Pane::Audit => AUDIT_SORT.iter().map(|c| c.name).collect(),
        Pane::Walkthrough | Pane::Metrics => Vec::new(),
    }
}

/// A pane's order before anyone sorts it.
pub fn default_order(pane: Pane) -> Order {
    match pane {
        // Newest first.
        Pane::Ledger | Pane::Audit => Order { column: 0, desc: true },
        // Unknown: oldest first; Approvals: soonest expiry; Live: soonest next attempt.
        _ => Order { column: 0, desc: false },
    }
}

/// `since ↑`.
pub fn label(pane: Pane, order: Order) -> Option<String> {
    let cols = columns(pane);
    let name = cols.get(order.column)?;
    Some(format!("{name} {}", if order.desc { "↓" } else { "↑" }))
}

impl App {
    /// The current pane's order.
    pub fn order(&self) -> Order {
        self.sorts.get(&self.pane).copied().unwrap_or_else(|| default_order(self.pane))
    }

    /// The current pane's order as the header shows it (`since ↑`).
    pub fn sort_label(&self) -> Option<String> {
        label(self.pane, self.order())
    }

    /// The name of the column the current pane is sorted by.
    pub fn sort_column(&self) -> Option<&'static str> {
        columns(self.pane).get(self.order().column).copied()
    }

    fn resort(&mut self, order: Order) -> Request {
        self.sorts.insert(self.pane, order);
        self.prefs_dirty = true;
        self.cursor = None;
        self.page_stack.clear();
        self.selected = 0;
        if let Some(l) = self.sort_label() {
            self.say(format!("sorted by {l}"), false);
        }
        self.fetch()
    }

    /// `s`: the next sort column (ascending).
    pub(super) fn cycle_sort(&mut self) -> Option<Request> {
        let n = columns(self.pane).len();
        if n == 0 {
            self.say("this pane has no table to sort", true);
            return None;
        }
        let column = (self.order().column + 1) % n;
        Some(self.resort(Order { column, desc: false }))
    }

    /// `S`: the other direction.
    pub(super) fn reverse_sort(&mut self) -> Option<Request> {
        if columns(self.pane).is_empty() {
            self.say("this pane has no table to sort", true);
            return None;
        }
        let o = self.order();
        Some(self.resort(Order { desc: !o.desc, ..o }))
    }

    /// `:sort COLUMN [asc|desc]` (ascending when not said).
    pub(super) fn sort_by(&mut self, column: &str, desc: Option<bool>) -> Result<Request, String> {
        let cols = columns(self.pane);
        if cols.is_empty() {
            return Err(format!("the {} pane has no table to sort", self.pane.title()));
        }
        // The filter calls the time in the current state `age`: so does `:sort`.
        let named = match column.to_ascii_lowercase().as_str() {
            "age" if cols.contains(&"since") => "since".to_string(),
            other => other.to_string(),
        };
        let Some(i) = cols.iter().position(|c| c.eq_ignore_ascii_case(&named)) else {
            return Err(format!(
                "the {} pane has no column {:?}; it sorts by {}",
                self.pane.title(),
                crate::tui::format::short(column, 20),
                cols.join(", ")
            ));
        };
        Ok(self.resort(Order { column: i, desc: desc.unwrap_or(false) }))
    }

    /// The cursor after the last fetched row, in the current order.
    pub(super) fn next_cursor(&self) -> Option<Cursor> {
        let o = self.order();
        match &self.rows {
            Rows::Live(r) => r.last().map(|x| cursor_after(LIVE_SORT, o, x, Key::Text(x.operation_id.clone()))),
            Rows::Ops(r) => r.last().map(|x| cursor_after(OPS_SORT, o, x, Key::Text(x.id.clone()))),
            Rows::Approvals(r) => r.last().map(|x| cursor_after(APPROVALS_SORT, o, x, Key::Text(x.id.clone()))),
            Rows::Audit(r) => r.last().map(|x| cursor_after(AUDIT_SORT, o, x, Key::Int(x.seq))),
            Rows::Metrics(_) | Rows::Empty => None,
        }
    }
}
