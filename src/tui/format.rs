//! Text for people, shared by the model (`app`: status lines, dialog evidence)
//! and the view (`ui`: panes, detail, popups). Plain `String`s, no ratatui
//! types: the view imports the model and this module, and the model never
//! imports the view.

/// `1h02m`, `5m03s`, `12s`, `450ms`; a negative duration reads as its magnitude
/// (callers say "overdue" or "ago").
pub fn human_ms(ms: i64) -> String {
    crate::display::duration(ms)
}

/// At most `n` characters of stored text, control characters written out first
/// (a control character never reaches the terminal), `…` when cut.
pub fn short(s: &str, n: usize) -> String {
    crate::display::clip(&crate::display::escape(s), n)
}

/// `12s ago`, or `never`.
pub fn ago(now_ms: i64, at: Option<i64>) -> String {
    at.map_or_else(|| "never".to_string(), |t| format!("{} ago", human_ms(now_ms.saturating_sub(t))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(got: impl AsRef<str>, expect: &str) {
        assert_eq!(got.as_ref(), expect);
    }

    #[test]
    fn stored_text_is_escaped_then_cut_on_characters() {
        check(short("op_0123456789abcdef", 8), "op_0123…");
        check(short("a\u{1b}[2Jb", 20), "a\\u{1b}[2Jb");
        check(short("ééé", 2), "é…");
    }

    #[test]
    fn ages_say_never_when_there_is_no_time() {
        check(ago(10_000, None), "never");
        check(ago(10_000, Some(7_000)), "3s ago");
    }
}
