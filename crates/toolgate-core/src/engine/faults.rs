//! Fault plans: scripted per call (`rate_limit(2000),ok`) or by rate with a seed
//! (`random(0.05,seed=7)`).

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The longest latency or Retry-After a fault may ask for: one hour.
pub const MAX_WAIT_MS: u64 = 3_600_000;
/// The longest receipt delay a fault may ask for: one week.
pub const MAX_RECEIPT_DELAY_MS: u64 = 7 * 24 * 3_600_000;
/// The largest reply body a fault may ask for: 64 MiB.
pub const MAX_HUGE_BODY_BYTES: u64 = 64 * 1024 * 1024;

/// The Retry-After a fault asks a provider to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryAfter {
    /// How long from now, in milliseconds.
    pub ms: u64,
    /// Written as an HTTP date (IMF-fixdate, RFC 9110 §5.6.7) that far ahead
    /// instead of as delta-seconds; only a provider served over HTTP writes it.
    pub http_date: bool,
}

impl RetryAfter {
    /// Delta-seconds.
    pub fn seconds(ms: u64) -> Self {
        Self { ms, http_date: false }
    }

    fn spec(self) -> String {
        if self.http_date {
            format!("{},date", self.ms)
        } else {
            self.ms.to_string()
        }
    }
}

/// One injected behaviour of a downstream call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Commit and reply.
    Ok,
    /// Wait, then commit; a wait beyond the attempt timeout loses the reply.
    Latency(u64),
    /// Definitive refusal, no effect.
    Reject(String),
    /// 429 with Retry-After, no effect.
    RateLimit(RetryAfter),
    /// 503 before accepting (with Retry-After when given), no effect.
    Unavailable(Option<RetryAfter>),
    /// The connection never opened, no effect.
    ConnectTimeout,
    /// Received, never committed, no reply.
    TimeoutBeforeCommit,
    /// Committed, reply lost.
    TimeoutAfterCommit,
    /// Committed, reply lost, and lookups see nothing for this long.
    ReceiptDelay(u64),
    /// Committed something other than what was asked (drift), reply lost.
    MismatchAfterCommit,
    /// Committed, reply unparseable.
    MalformedResponse,
    /// Committed, then the handler panics.
    PanicAfterCommit,
    /// Committed, then the process aborts.
    CrashAfterCommit,
    /// Committed, then the connection drops with no reply (a reset after the
    /// request was written).
    DropAfterCommit,
    /// The same key is still being processed (409 with Retry-After, ms): no effect yet.
    InProgress(u64),
    /// Committed, then a 500: a server error after the request was sent.
    ServerErrorAfterCommit,
    /// A 500 and nothing committed (what a provider whose 5xx means "not
    /// committed" does).
    ServerError,
    /// Committed, and the receipt arrives slowly: over HTTP the 200 comes at
    /// once and its body trickles in over this many ms.
    SlowBody(u64),
    /// Committed, and the receipt is this many bytes long (padded with JSON
    /// whitespace): larger than the caller reads.
    HugeBody(u64),
    /// A misbehaving provider (redaction tests): commits, and its reply echoes a
    /// credential in an `authorization` header and, when `in_result`, in an
    /// undeclared result field too. Its own records stay clean.
    EchoCredential {
        /// The credential-looking value echoed.
        value: String,
        /// Also put it in the result body (which then breaks the output contract).
        in_result: bool,
    },
}

/// A fault spec that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad fault spec {0:?}: expected e.g. ok, latency(ms), reject(code), rate_limit(ms[,date]), unavailable, unavailable(ms[,date]), connect_timeout, timeout_before_commit, timeout_after_commit, receipt_delay(ms), mismatch_after_commit, malformed_response, panic_after_commit, crash_after_commit, drop_after_commit, in_progress(ms), server_error_after_commit, server_error, slow_body(ms), huge_body(bytes), or random(rate,seed=N)")]
pub struct FaultParseError(pub String);

impl Fault {
    /// The spec [`Fault::parse`] reads back (how a fault travels in the
    /// `Toolgate-Fault` header to a provider served over HTTP).
    pub fn spec(&self) -> String {
        match self {
            Fault::Ok => "ok".into(),
            Fault::Latency(ms) => format!("latency({ms})"),
            Fault::Reject(code) => format!("reject({code})"),
            Fault::RateLimit(ra) => format!("rate_limit({})", ra.spec()),
            Fault::Unavailable(None) => "unavailable".into(),
            Fault::Unavailable(Some(ra)) => format!("unavailable({})", ra.spec()),
            Fault::ConnectTimeout => "connect_timeout".into(),
            Fault::TimeoutBeforeCommit => "timeout_before_commit".into(),
            Fault::TimeoutAfterCommit => "timeout_after_commit".into(),
            Fault::ReceiptDelay(ms) => format!("receipt_delay({ms})"),
            Fault::MismatchAfterCommit => "mismatch_after_commit".into(),
            Fault::MalformedResponse => "malformed_response".into(),
            Fault::PanicAfterCommit => "panic_after_commit".into(),
            Fault::CrashAfterCommit => "crash_after_commit".into(),
            Fault::DropAfterCommit => "drop_after_commit".into(),
            Fault::InProgress(ms) => format!("in_progress({ms})"),
            Fault::ServerErrorAfterCommit => "server_error_after_commit".into(),
            Fault::ServerError => "server_error".into(),
            Fault::SlowBody(ms) => format!("slow_body({ms})"),
            Fault::HugeBody(bytes) => format!("huge_body({bytes})"),
            Fault::EchoCredential { value, in_result: false } => format!("echo_header({value})"),
            Fault::EchoCredential { value, in_result: true } => format!("echo_credential({value})"),
        }
    }

    /// Parses one fault (durations in milliseconds, bounded: see [`MAX_WAIT_MS`]).
    pub fn parse(s: &str) -> Result<Fault, FaultParseError> {
        let s = s.trim();
        let bad = || FaultParseError(s.chars().take(64).collect());
        let (name, arg) = match s.find('(') {
            Some(i) if s.ends_with(')') => (&s[..i], Some(&s[i + 1..s.len() - 1])),
            Some(_) => return Err(bad()),
            None => (s, None),
        };
        // Every duration is bounded like any other input: a fault plan cannot
        // ask for a wait longer than these (latency and Retry-After one hour,
        // a receipt delay one week).
        let num_max = |max: u64| -> Result<u64, FaultParseError> {
            arg.and_then(|a| a.trim().parse::<u64>().ok()).filter(|n| *n <= max).ok_or_else(bad)
        };
        let num = || num_max(MAX_RECEIPT_DELAY_MS);
        // `ms` or `ms,date`: a Retry-After as delta-seconds or as an HTTP date.
        let retry_after = || -> Result<RetryAfter, FaultParseError> {
            let a = arg.ok_or_else(bad)?;
            let (ms, http_date) = match a.split_once(',') {
                Some((ms, form)) if form.trim() == "date" => (ms, true),
                Some(_) => return Err(bad()),
                None => (a, false),
            };
            let ms = ms.trim().parse::<u64>().ok().filter(|n| *n <= MAX_WAIT_MS).ok_or_else(bad)?;
            Ok(RetryAfter { ms, http_date })
        };
        let f = match (name, arg) {
            ("ok", None) => Fault::Ok,
            ("latency", Some(_)) => Fault::Latency(num_max(MAX_WAIT_MS)?),
            ("reject", Some(code)) if !code.is_empty() && code.len() <= 64 => Fault::Reject(code.to_string()),
            ("rate_limit", Some(_)) => Fault::RateLimit(retry_after()?),
            ("unavailable", None) => Fault::Unavailable(None),
            ("unavailable", Some(_)) => Fault::Unavailable(Some(retry_after()?)),
            ("connect_timeout", None) => Fault::ConnectTimeout,
            ("timeout_before_commit", None) => Fault::TimeoutBeforeCommit,
            ("timeout_after_commit", None) => Fault::TimeoutAfterCommit,
            ("receipt_delay", Some(_)) => Fault::ReceiptDelay(num()?),
            ("mismatch_after_commit", None) => Fault::MismatchAfterCommit,
            ("malformed_response", None) => Fault::MalformedResponse,
            ("panic_after_commit", None) => Fault::PanicAfterCommit,
            ("crash_after_commit", None) => Fault::CrashAfterCommit,
            ("drop_after_commit", None) => Fault::DropAfterCommit,
            ("in_progress", Some(_)) => Fault::InProgress(num_max(MAX_WAIT_MS)?),
            ("server_error_after_commit", None) => Fault::ServerErrorAfterCommit,
            ("server_error", None) => Fault::ServerError,
            ("slow_body", Some(_)) => Fault::SlowBody(num_max(MAX_WAIT_MS)?),
            ("huge_body", Some(_)) => Fault::HugeBody(num_max(MAX_HUGE_BODY_BYTES)?),
            ("echo_header", Some(v)) if !v.is_empty() && v.len() <= 128 => {
                Fault::EchoCredential { value: v.to_string(), in_result: false }
            }
            ("echo_credential", Some(v)) if !v.is_empty() && v.len() <= 128 => {
                Fault::EchoCredential { value: v.to_string(), in_result: true }
            }
            _ => return Err(bad()),
        };
        Ok(f)
    }
}

/// Splits a script at the commas between faults, not those inside a fault's
/// parentheses (`unavailable(3000,date),ok` is two faults).
fn split_top_level(spec: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in spec.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&spec[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&spec[start..]);
    out
}

/// The faults the next calls will meet.
#[derive(Debug)]
pub struct FaultPlan {
    script: VecDeque<Fault>,
    random: Option<(f64, StdRng)>,
}

impl Default for FaultPlan {
    fn default() -> Self {
        Self::none()
    }
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self { script: VecDeque::new(), random: None }
    }

    /// A script consumed one fault per call; `ok` after it runs out.
    pub fn script(faults: impl IntoIterator<Item = Fault>) -> Self {
        Self { script: faults.into_iter().collect(), random: None }
    }

    /// Parses `f1,f2,...` or `random(RATE,seed=N)`.
    pub fn parse(spec: &str) -> Result<Self, FaultParseError> {
        let spec = spec.trim();
        if spec.len() > 4096 {
            return Err(FaultParseError(spec.chars().take(64).collect()));
        }
        if let Some(inner) = spec.strip_prefix("random(").and_then(|s| s.strip_suffix(')')) {
            let mut parts = inner.split(',');
            let rate = parts.next().and_then(|r| r.trim().parse::<f64>().ok());
            let seed = parts.next().and_then(|s| s.trim().strip_prefix("seed=")).and_then(|s| s.parse::<u64>().ok());
            return match (rate, seed, parts.next()) {
                (Some(r), Some(seed), None) if (0.0..=1.0).contains(&r) => {
                    Ok(Self { script: VecDeque::new(), random: Some((r, StdRng::seed_from_u64(seed))) })
                }
                _ => Err(FaultParseError(spec.chars().take(64).collect())),
            };
        }
        let faults = split_top_level(spec).into_iter().map(Fault::parse).collect::<Result<Vec<_>, _>>()?;
        Ok(Self::script(faults))
    }

    /// The fault for the next call.
    pub fn next_fault(&mut self) -> Fault {
        if let Some(f) = self.script.pop_front() {
            return f;
        }
        if let Some((rate, rng)) = &mut self.random {
            // A rate of 1 is an outage: the provider is down, so every call
            // fails the way a down provider fails (the breaker counts each),
            // and nothing commits. A 429 or a committed lost reply is a
            // provider that is up: one of those closed the breaker again.
            if *rate >= 1.0 {
                return match rng.gen_range(0..3) {
                    0 => Fault::Unavailable(None),
                    1 => Fault::ConnectTimeout,
                    _ => Fault::TimeoutBeforeCommit,
                };
            }
            if rng.gen_bool(*rate) {
                // Mostly transient faults, some lost replies: what a flaky provider does.
                return match rng.gen_range(0..6) {
                    0 => Fault::RateLimit(RetryAfter::seconds(rng.gen_range(50..500))),
                    1 => Fault::Unavailable(None),
                    2 => Fault::ConnectTimeout,
                    3 => Fault::TimeoutAfterCommit,
                    4 => Fault::TimeoutBeforeCommit,
                    _ => Fault::ReceiptDelay(rng.gen_range(100..2000)),
                };
            }
        }
        Fault::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::needless_pass_by_value)]
    fn check(spec: &str, expect: Result<Vec<Fault>, ()>) {
        let got = FaultPlan::parse(spec)
            .map(|mut p| (0..expect.as_ref().map_or(0, Vec::len)).map(|_| p.next_fault()).collect::<Vec<_>>());
        assert_eq!(got.map_err(|_| ()), expect, "spec {spec}");
    }

    #[test]
    fn every_spec_reads_back() {
        for spec in [
            "ok",
            "latency(5)",
            "reject(card_declined)",
            "rate_limit(2000)",
            "rate_limit(2000,date)",
            "unavailable",
            "unavailable(3000)",
            "unavailable(3000,date)",
            "connect_timeout",
            "timeout_before_commit",
            "timeout_after_commit",
            "receipt_delay(7)",
            "mismatch_after_commit",
            "malformed_response",
            "panic_after_commit",
            "crash_after_commit",
            "drop_after_commit",
            "in_progress(9)",
            "server_error_after_commit",
            "server_error",
            "slow_body(1500)",
            "huge_body(1048576)",
            "echo_header(t)",
            "echo_credential(t)",
        ] {
            assert_eq!(Fault::parse(spec).map(|f| f.spec()), Ok(spec.to_string()));
        }
    }

    #[test]
    fn parses_scripts() {
        check("ok", Ok(vec![Fault::Ok, Fault::Ok]));
        check("rate_limit(2000),ok", Ok(vec![Fault::RateLimit(RetryAfter::seconds(2000)), Fault::Ok]));
        check("unavailable", Ok(vec![Fault::Unavailable(None)]));
        check("unavailable(3000)", Ok(vec![Fault::Unavailable(Some(RetryAfter::seconds(3000)))]));
        check("unavailable(3000,date)", Ok(vec![Fault::Unavailable(Some(RetryAfter { ms: 3000, http_date: true }))]));
        check(
            "rate_limit(2000,date),unavailable(5,date),ok",
            Ok(vec![
                Fault::RateLimit(RetryAfter { ms: 2000, http_date: true }),
                Fault::Unavailable(Some(RetryAfter { ms: 5, http_date: true })),
                Fault::Ok,
            ]),
        );
        check("unavailable(3000,soon)", Err(()));
        check("unavailable(3000,date,date)", Err(()));
        check("rate_limit(,date)", Err(()));
        check("huge_body(67108865)", Err(()));
        check("receipt_delay(5000)", Ok(vec![Fault::ReceiptDelay(5000)]));
        check("reject(card_declined)", Ok(vec![Fault::Reject("card_declined".into())]));
        check("crash_after_commit", Ok(vec![Fault::CrashAfterCommit]));
        check("drop_after_commit,in_progress(1500)", Ok(vec![Fault::DropAfterCommit, Fault::InProgress(1500)]));
        check("server_error_after_commit", Ok(vec![Fault::ServerErrorAfterCommit]));
        check("echo_header(tok_1)", Ok(vec![Fault::EchoCredential { value: "tok_1".into(), in_result: false }]));
        check("echo_credential(tok_2)", Ok(vec![Fault::EchoCredential { value: "tok_2".into(), in_result: true }]));
        check("echo_header()", Err(()));
        check("nope", Err(()));
        check("latency(x)", Err(()));
        check("latency(5", Err(()));
        check("random(2.0,seed=1)", Err(()));
        assert!(FaultPlan::parse("random(0.5,seed=1)").is_ok());
    }

    /// Issue 32 §2: at 100% one fault in six was a 429 (a provider that is
    /// up, which closed the breaker again) and some committed. An outage is
    /// an outage: every fault is one a down provider gives, and none commits.
    #[test]
    fn a_rate_of_one_is_an_outage() {
        for seed in 0..20 {
            let mut p = FaultPlan::parse(&format!("random(1.0,seed={seed})")).unwrap();
            for _ in 0..200 {
                let f = p.next_fault();
                assert!(
                    matches!(f, Fault::Unavailable(None) | Fault::ConnectTimeout | Fault::TimeoutBeforeCommit),
                    "seed {seed}: {f:?}"
                );
            }
        }
    }
}
