//! Text for people, shared by the model (`app`: status lines, dialog evidence)
//! and the view (`ui`: panes, detail, popups). Plain `String`s, no ratatui
//! types: the view imports the model and this module, and the model never
//! imports the view.

/// `1h02m`, `5m03s`, `12s`, `450ms`; a negative duration reads as its magnitude
/// (callers say "overdue" or "ago").
pub fn human_ms(ms: i64) -> String {
    crate::display::duration(ms)
}

/// [`human_ms`] in at most `width` cells, in whole units: `339d 13h`, or
/// `339d` when that does not fit (never `339d 13`, a number without its unit).
pub fn duration_in(ms: i64, width: usize) -> String {
    let full = human_ms(ms);
    if full.chars().count() <= width {
        return full;
    }
    // The largest unit alone: its digits and its letters.
    let mut major = String::new();
    for c in full.chars() {
        if (c.is_ascii_digit() && major.chars().last().is_some_and(|l| l.is_ascii_alphabetic())) || c == ' ' {
            break;
        }
        major.push(c);
    }
    major
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

/// `07:58:12`, the time of day (UTC) of an instant in ms since the epoch.
pub fn time_of_day(at: i64) -> String {
    crate::engine::clock::rfc3339(at).chars().skip(11).take(8).collect()
}

/// `in 12s`, or `overdue 3s` once `at` has passed (a deadline, a due time).
pub fn due_in(now_ms: i64, at: i64) -> String {
    if at > now_ms {
        format!("in {}", human_ms(at.saturating_sub(now_ms)))
    } else {
        crate::display::countdown(at.saturating_sub(now_ms))
    }
}

/// `in 12s`, or `expired 3s ago` once `at` has passed (a lease end, an expiry).
pub fn lapses_in(now_ms: i64, at: i64) -> String {
    if at > now_ms {
        format!("in {}", human_ms(at.saturating_sub(now_ms)))
    } else {
        crate::display::expiry(at.saturating_sub(now_ms))
    }
}

/// `08:14:26 UTC (in 14m26s)` / `(overdue 3s)`: [`due_in`] with the time of day.
pub fn due_at(now_ms: i64, at: i64) -> String {
    format!("{} UTC ({})", time_of_day(at), due_in(now_ms, at))
}

/// `08:14:26 UTC (in 14m26s)` / `(expired 3s ago)`: [`lapses_in`] with the time of day.
pub fn lapses_at(now_ms: i64, at: i64) -> String {
    format!("{} UTC ({})", time_of_day(at), lapses_in(now_ms, at))
}

/// Retry tokens from thousandths: `3`, `2.5` (tenths, rounded down), never negative.
pub fn tokens(milli: i64) -> String {
    let milli = milli.max(0);
    let (whole, tenths) = (milli / 1000, milli % 1000 / 100);
    if tenths == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{tenths}")
    }
}

pub use crate::display::money;

/// The amount of an approval's bound request as money, read from the
/// digest-checked request (never the copy beside it); `None` when it has no
/// amount or the record is damaged.
pub fn approval_money(a: &crate::store::ApprovalRow) -> Option<String> {
    let minor = crate::engine::approval_amount(a)?;
    // approval_amount checked the request against its digest: its currency is the bound one.
    let v: serde_json::Value = serde_json::from_str(&a.request_json).ok()?;
    let currency = v.get("arguments")?.get("currency").and_then(serde_json::Value::as_str).unwrap_or("");
    Some(money(minor, currency))
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
    fn tokens_and_times_of_day() {
        check(tokens(10_000), "10");
        check(tokens(2_599), "2.5");
        check(tokens(999), "0.9");
        check(tokens(-5), "0");
        check(time_of_day(1_800_000_000_000), "08:00:00");
        check(due_at(1_800_000_000_000, 1_800_000_060_000), "08:01:00 UTC (in 1m00s)");
        check(due_at(1_800_000_003_000, 1_800_000_000_000), "08:00:00 UTC (overdue 3s)");
        check(lapses_at(1_800_000_003_000, 1_800_000_000_000), "08:00:00 UTC (expired 3s ago)");
        // Stored times out of chrono's range never panic.
        assert!(lapses_at(i64::MAX, i64::MIN).contains("(expired 106751991167d 7h ago)"));
        assert!(due_at(i64::MIN, i64::MAX).contains("(in 106751991167d 7h)"));
    }

    #[test]
    fn a_duration_in_a_narrow_cell_keeps_whole_units() {
        let day = 86_400_000;
        check(duration_in(339 * day + 13 * 3_600_000, 8), "339d 13h");
        check(duration_in(339 * day + 13 * 3_600_000, 7), "339d");
        check(duration_in(1_339 * day + 13 * 3_600_000, 7), "1339d");
        check(duration_in(12 * 3_600_000 + 5 * 60_000, 5), "12h");
        check(duration_in(5 * 60_000 + 3_000, 7), "5m03s");
    }

    #[test]
    fn ages_say_never_when_there_is_no_time() {
        check(ago(10_000, None), "never");
        check(ago(10_000, Some(7_000)), "3s ago");
    }
}
