//! Fault plans: scripted per call (`rate_limit(2000),ok`) or by rate with a seed
//! (`random(0.05,seed=7)`).

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The longest latency or Retry-After a fault may ask for: one hour.
pub const MAX_WAIT_MS: u64 = 3_600_000;
/// The longest receipt delay a fault may ask for: one week.
pub const MAX_RECEIPT_DELAY_MS: u64 = 7 * 24 * 3_600_000;

/// One injected behaviour of a downstream call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Commit and reply.
    Ok,
    /// Wait, then commit; a wait beyond the attempt timeout loses the reply.
    Latency(u64),
    /// Definitive refusal, no effect.
    Reject(String),
    /// 429 with Retry-After (ms), no effect.
    RateLimit(u64),
    /// 503 before accepting, no effect.
    Unavailable,
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
#[error("bad fault spec {0:?}: expected e.g. ok, latency(ms), reject(code), rate_limit(ms), unavailable, connect_timeout, timeout_before_commit, timeout_after_commit, receipt_delay(ms), mismatch_after_commit, malformed_response, panic_after_commit, crash_after_commit, drop_after_commit, in_progress(ms), server_error_after_commit, or random(rate,seed=N)")]
pub struct FaultParseError(pub String);

impl Fault {
    /// The spec [`Fault::parse`] reads back (how a fault travels in the
    /// `Toolgate-Fault` header to a provider served over HTTP).
    pub fn spec(&self) -> String {
        match self {
            Fault::Ok => "ok".into(),
            Fault::Latency(ms) => format!("latency({ms})"),
            Fault::Reject(code) => format!("reject({code})"),
            Fault::RateLimit(ms) => format!("rate_limit({ms})"),
            Fault::Unavailable => "unavailable".into(),
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
        let f = match (name, arg) {
            ("ok", None) => Fault::Ok,
            ("latency", Some(_)) => Fault::Latency(num_max(MAX_WAIT_MS)?),
            ("reject", Some(code)) if !code.is_empty() && code.len() <= 64 => Fault::Reject(code.to_string()),
            ("rate_limit", Some(_)) => Fault::RateLimit(num_max(MAX_WAIT_MS)?),
            ("unavailable", None) => Fault::Unavailable,
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
        let faults = spec.split(',').map(Fault::parse).collect::<Result<Vec<_>, _>>()?;
        Ok(Self::script(faults))
    }

    /// The fault for the next call.
    pub fn next_fault(&mut self) -> Fault {
        if let Some(f) = self.script.pop_front() {
            return f;
        }
        if let Some((rate, rng)) = &mut self.random {
            if rng.gen_bool(*rate) {
                // Mostly transient faults, some lost replies: what a flaky provider does.
                return match rng.gen_range(0..6) {
                    0 => Fault::RateLimit(rng.gen_range(50..500)),
                    1 => Fault::Unavailable,
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
            "unavailable",
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
            "echo_header(t)",
            "echo_credential(t)",
        ] {
            assert_eq!(Fault::parse(spec).map(|f| f.spec()), Ok(spec.to_string()));
        }
    }

    #[test]
    fn parses_scripts() {
        check("ok", Ok(vec![Fault::Ok, Fault::Ok]));
        check("rate_limit(2000),ok", Ok(vec![Fault::RateLimit(2000), Fault::Ok]));
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
}
