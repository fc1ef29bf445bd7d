//! Showing stored text to a person, safely: the CLI and the console print
//! through these. Nothing here trusts the shape of what is stored (a row may
//! have been edited by hand): no slicing by byte index, every control
//! character escaped so stored text cannot move the cursor, clear the screen or
//! fake a line, and a digest that is not one is marked instead of shortened.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Marks a stored value whose shape is wrong (`toolgate audit` names the row).
pub const DAMAGED: &str = "!damaged";

/// Whether `s` is a 64-hex-digit SHA-256 as the ledger writes them.
pub fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The first `n` hex digits of a stored digest, or, when the value is not a
/// digest, `!` and what is there (escaped, at most `n` characters).
pub fn digest(s: &str, n: usize) -> String {
    if is_digest(s) {
        s.chars().take(n).collect()
    } else {
        format!("!{}", clip(&escape(s), n.saturating_sub(1)))
    }
}

/// At most `n` characters of `s` (on character boundaries), with `…` when cut.
pub fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// Whether a character must not reach a terminal as it is: C0 and C1 controls,
/// DEL, and the bidirectional overrides that reorder what is shown.
fn unsafe_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// `s` with every control character written out (`\n`, `\t`, `\u{1b}`), so a
/// stored note or name prints on one line and as itself.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if unsafe_char(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Digits after the decimal point of a currency's minor unit (ISO 4217; two
/// unless listed).
fn minor_digits(currency: &str) -> u32 {
    match currency {
        "BIF" | "CLP" | "DJF" | "GNF" | "ISK" | "JPY" | "KMF" | "KRW" | "PYG" | "RWF" | "UGX" | "VND" | "VUV"
        | "XAF" | "XOF" | "XPF" => 0,
        "BHD" | "IQD" | "JOD" | "KWD" | "LYD" | "OMR" | "TND" => 3,
        _ => 2,
    }
}

/// Money for people: `1,500.00 EUR` from `150000` minor units. A currency that
/// is not three capital letters is shown escaped and the amount in minor units.
pub fn money(minor: i64, currency: &str) -> String {
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return format!("{minor} (minor units, currency {})", clip(&escape(currency), 8));
    }
    let digits = minor_digits(currency);
    let scale = 10u128.pow(digits);
    let abs = u128::from(minor.unsigned_abs());
    let (whole, frac) = (abs / scale, abs % scale);
    let whole = whole.to_string();
    let mut grouped = String::with_capacity(whole.len() + whole.len() / 3);
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    let sign = if minor < 0 { "-" } else { "" };
    if digits == 0 {
        format!("{sign}{grouped} {currency}")
    } else {
        format!("{sign}{grouped}.{frac:0width$} {currency}", width = digits as usize)
    }
}

/// A duration for people: `401ms`, `12s`, `1m29s`, `8h41m`, `336d 4h`.
/// Negative durations read as their magnitude (callers say "overdue" or "ago").
pub fn duration(ms: i64) -> String {
    let ms = ms.unsigned_abs();
    let s = ms / 1000;
    if s >= 86_400 {
        format!("{}d {}h", s / 86_400, (s % 86_400) / 3600)
    } else if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s > 0 {
        format!("{s}s")
    } else {
        format!("{ms}ms")
    }
}

/// Time left until a deadline: the duration, or `overdue 3s` (by how much)
/// once it has passed; never a negative countdown.
pub fn countdown(ms_left: i64) -> String {
    if ms_left <= 0 {
        format!("overdue {}", duration(ms_left))
    } else {
        duration(ms_left)
    }
}

/// Time left until something lapses (a lease, an approval): the duration, or
/// `expired 3s ago` once it has.
pub fn expiry(ms_left: i64) -> String {
    if ms_left <= 0 {
        format!("expired {} ago", duration(ms_left))
    } else {
        duration(ms_left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn money_reads_as_money() {
        assert_eq!(money(150_000, "EUR"), "1,500.00 EUR");
        assert_eq!(money(120_000, "EUR"), "1,200.00 EUR");
        assert_eq!(money(5, "USD"), "0.05 USD");
        assert_eq!(money(0, "EUR"), "0.00 EUR");
        assert_eq!(money(-123_456_789, "GBP"), "-1,234,567.89 GBP");
        assert_eq!(money(1_500, "JPY"), "1,500 JPY");
        assert_eq!(money(1_500, "KWD"), "1.500 KWD");
        assert_eq!(money(100, "EURO"), "100 (minor units, currency EURO)");
        assert_eq!(money(100, "e\u{1b}"), "100 (minor units, currency e\\u{1b})");
        assert_eq!(money(i64::MIN, "EUR"), "-92,233,720,368,547,758.08 EUR");
        assert_eq!(money(i64::MAX, "EUR"), "92,233,720,368,547,758.07 EUR");
    }

    fn check(got: impl AsRef<str>, expect: &str) {
        assert_eq!(got.as_ref(), expect);
    }

    #[test]
    fn digests_are_shortened_only_when_they_are_digests() {
        let d = "ab".repeat(32);
        check(digest(&d, 8), "abababab");
        check(digest("abc", 8), "!abc");
        check(digest("ééééééééééé", 8), "!éééééé…");
        check(digest("", 8), "!");
    }

    #[test]
    fn control_characters_are_written_out() {
        check(escape("ev\u{1b}[2Jil\nnext\u{202e}"), "ev\\u{1b}[2Jil\\nnext\\u{202e}");
        check(escape("plain text"), "plain text");
        check(escape("tab\there\u{7f}"), "tab\\there\\u{7f}");
    }

    #[test]
    fn durations_read_in_days_past_a_day_and_never_overflow() {
        check(duration(401), "401ms");
        check(duration(89_000), "1m29s");
        check(duration(31_260_000), "8h41m");
        check(duration((336 * 24 + 4) * 3_600_000 + 5), "336d 4h");
        check(duration(-89_000), "1m29s");
        check(duration(i64::MIN), "106751991167d 7h");
        check(countdown(-29_029_000), "overdue 8h03m");
        check(countdown(-3_000), "overdue 3s");
        check(countdown(0), "overdue 0ms");
        check(countdown(1_500), "1s");
        check(countdown(i64::MIN), "overdue 106751991167d 7h");
        check(expiry(-4_000), "expired 4s ago");
        check(expiry(60_000), "1m00s");
    }
}
