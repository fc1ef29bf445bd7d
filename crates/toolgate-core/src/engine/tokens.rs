//! Bearer tokens for the HTTP API: who a caller is, never what it asserts.
//!
//! A token is `tgt_<public>_<secret>`: `public` is 16 hex digits (8 random
//! bytes) that find the row, `secret` is 43 base64url characters (32 random
//! bytes from the operating system) that prove possession. The ledger keeps the
//! public part (shown in lists) and the SHA-256 of the secret, never the token.
//!
//! A fast hash is the right tool here, unlike for passwords: slow password
//! hashes (argon2, bcrypt) exist because people choose guessable passwords,
//! so an attacker holding the table can try likely ones. A secret of 256
//! random bits has no likely values: a SHA-256 preimage search over 2^256 is
//! out of reach however fast each try is, and a cheap check keeps the per-request
//! authentication (the table is read at every request, so a revocation is seen
//! by the next one) from becoming the bottleneck.
//!
//! The row is found by the public part (a lookup whose timing depends only on
//! what the caller already shows), then the secret's digest is compared in
//! constant time, so response timing tells nothing about how much of a guessed
//! secret was right.

use rand::RngCore as _;
use subtle::ConstantTimeEq as _;

use super::canonical::sha256_hex;
use super::envelope::{Code, Delivery, Envelope, ProtectedAudit};
use super::operation::{args_of, authorize, op_envelope, verify_row};
use super::trace::TraceEvent;
use super::{check_name, check_operator, error_envelope, Engine, EngineError, MAX_NAME_CHARS};
use crate::store::Reason;
use crate::store::Step;
use crate::store::{StoreError, TokenRow};

/// What every token starts with.
pub const TOKEN_PREFIX: &str = "tgt_";
/// Hex digits of the public part.
const PUBLIC_HEX: usize = 16;
/// Characters of the secret part (32 bytes, base64url without padding).
const SECRET_CHARS: usize = 43;

/// Who a token says the caller is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// An agent acting for one subject of one tenant: may dispatch, query its
    /// own operations' status and read its own operations; never approve,
    /// deny, resolve or cancel.
    Subject {
        /// Tenant.
        tenant: String,
        /// Subject.
        subject: String,
        /// The token's id.
        token_id: String,
    },
    /// A person: may approve, deny, resolve and cancel; never dispatch as a subject.
    Operator {
        /// The operator's name (the approver name in approvals, the actor in the operator log).
        operator: String,
        /// The token's id.
        token_id: String,
        /// The tenants the token may act in; `None`: every tenant.
        tenants: Option<Vec<String>>,
    },
}

/// Why a request's token was refused. Each has a stable code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization` header.
    Missing,
    /// Not `Bearer tgt_…` of the right shape.
    Malformed,
    /// No such token (or the secret does not match).
    Unknown,
    /// Past its expiry.
    Expired,
    /// Revoked.
    Revoked,
}

impl AuthFailure {
    /// The stable code.
    pub fn code(self) -> &'static str {
        match self {
            AuthFailure::Missing => "TOKEN_MISSING",
            AuthFailure::Malformed => "TOKEN_MALFORMED",
            AuthFailure::Unknown => "TOKEN_UNKNOWN",
            AuthFailure::Expired => "TOKEN_EXPIRED",
            AuthFailure::Revoked => "TOKEN_REVOKED",
        }
    }

    /// The trace event's reason (low cardinality, lower case).
    fn reason(self) -> Reason {
        match self {
            AuthFailure::Missing => Reason::TokenMissing,
            AuthFailure::Malformed => Reason::TokenMalformed,
            AuthFailure::Unknown => Reason::TokenUnknown,
            AuthFailure::Expired => Reason::TokenExpired,
            AuthFailure::Revoked => Reason::TokenRevoked,
        }
    }

    /// The fixed message the caller sees.
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "An Authorization: Bearer token is required.",
            AuthFailure::Malformed => "The Authorization header is not a toolgate bearer token.",
            AuthFailure::Unknown => "The bearer token is not known.",
            AuthFailure::Expired => "The bearer token has expired.",
            AuthFailure::Revoked => "The bearer token has been revoked.",
        }
    }
}

/// Whom a new token is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFor {
    /// A subject of a tenant (an agent).
    Subject {
        /// Tenant.
        tenant: String,
        /// Subject.
        subject: String,
    },
    /// An operator, in some tenants (`None`: every tenant, stated explicitly).
    Operator {
        /// The operator's name.
        operator: String,
        /// The tenants it may act in; `None` for all of them.
        tenants: Option<Vec<String>>,
    },
}

/// A token just made: the token itself (shown once, never stored) and its row.
#[derive(Debug, Clone)]
pub struct NewToken {
    /// The bearer token. Print it once; the ledger cannot show it again.
    pub token: String,
    /// What the ledger keeps.
    pub row: TokenRow,
}

/// The digest the ledger keeps for a token's secret (domain-separated, bound
/// to the public part).
fn secret_digest(public: &str, secret: &str) -> String {
    sha256_hex(format!("toolgate api token v1\0{public}\0{secret}").as_bytes())
}

/// Splits `tgt_<16 hex>_<43 base64url>` into (public part with its prefix, secret).
fn parse_token(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    if rest.len() != PUBLIC_HEX + 1 + SECRET_CHARS || !rest.is_char_boundary(PUBLIC_HEX) {
        return None;
    }
    let (public_hex, tail) = rest.split_at(PUBLIC_HEX);
    let secret = tail.strip_prefix('_')?;
    let hex_ok = public_hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let b64_ok = secret.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (hex_ok && b64_ok).then(|| (&token[..TOKEN_PREFIX.len() + PUBLIC_HEX], secret))
}

/// Reads the token out of an `Authorization` header value.
fn bearer(header: Option<&[u8]>) -> Result<(&str, &str), AuthFailure> {
    let Some(raw) = header else { return Err(AuthFailure::Missing) };
    let text = std::str::from_utf8(raw).map_err(|_| AuthFailure::Malformed)?;
    let (scheme, token) = text.trim().split_once(' ').ok_or(AuthFailure::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthFailure::Malformed);
    }
    parse_token(token.trim()).ok_or(AuthFailure::Malformed)
}

/// Whether an `Authorization` header holds a well-formed bearer token,
/// without looking it up: the server checks the shape before it reads a
/// body, and leaves the lookup (and any refusal's trace event) to
/// [`Engine::authenticate`].
pub fn well_formed(authorization: Option<&[u8]>) -> bool {
    bearer(authorization).is_ok()
}

impl Engine {
    /// Makes a bearer token for a subject or an operator. The token is in the
    /// answer only; the ledger keeps its public part and its secret's digest.
    pub fn create_token(
        &mut self,
        who: &TokenFor,
        name: Option<&str>,
        expires_at: Option<i64>,
    ) -> Result<NewToken, EngineError> {
        let now = self.clock.now_ms();
        if let Some(n) = name {
            check_name("the token name", n, MAX_NAME_CHARS).map_err(|m| EngineError::invalid("INVALID_NAME", m))?;
        }
        if expires_at.is_some_and(|t| t <= now) {
            return Err(EngineError::invalid("TOKEN_EXPIRY_PAST", "the expiry is not in the future"));
        }
        let (kind, tenant, subject, operator) = match who {
            TokenFor::Subject { tenant, subject } => {
                let t = self.store.read(|tx| tx.subject_tenant(subject))?;
                if t.as_deref() != Some(tenant.as_str()) {
                    return Err(EngineError::invalid("UNKNOWN_SUBJECT", "no such subject in that tenant"));
                }
                ("subject", Some(tenant.clone()), Some(subject.clone()), None)
            }
            TokenFor::Operator { operator, tenants } => {
                check_operator(operator)?;
                if let Some(list) = tenants {
                    if list.is_empty() {
                        return Err(EngineError::invalid(
                            "NO_TENANT",
                            "name at least one tenant, or every tenant explicitly",
                        ));
                    }
                    for t in list {
                        if self.store.read(|tx| tx.tenant(t))?.is_none() {
                            return Err(EngineError::invalid("UNKNOWN_TENANT", format!("no tenant {t:?}")));
                        }
                    }
                }
                ("operator", None, None, Some(operator.clone()))
            }
        };
        let operator_tenants = match who {
            TokenFor::Operator { tenants: Some(list), .. } => {
                let mut list = list.clone();
                list.sort();
                list.dedup();
                Some(list.join(","))
            }
            _ => None,
        };
        // Operating-system entropy, never the engine's id generator: that one
        // may be seeded (deterministic runs), and a token must not be predictable.
        let mut public = [0u8; PUBLIC_HEX / 2];
        let mut secret = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut public);
        rand::rngs::OsRng.fill_bytes(&mut secret);
        let prefix = format!("{TOKEN_PREFIX}{}", hex::encode(public));
        let secret = {
            use base64::Engine as _;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
        };
        let row = TokenRow {
            id: format!("tok_{}", hex::encode(public)),
            secret_sha256: secret_digest(&prefix, &secret),
            prefix: prefix.clone(),
            kind: kind.into(),
            tenant,
            subject,
            operator,
            name: name.map(str::to_string),
            created_at: now,
            expires_at,
            revoked_at: None,
            operator_tenants,
        };
        self.store.write(|tx| tx.insert_token(&row))?;
        Ok(NewToken { token: format!("{prefix}_{secret}"), row })
    }

    /// Every token, newest first (no secrets: the ledger has none to show).
    pub fn tokens(&mut self) -> Result<Vec<TokenRow>, EngineError> {
        #[allow(clippy::redundant_closure_for_method_calls)] // the method path is not general over the lifetime
        let rows = self.store.read(|tx| tx.tokens())?;
        Ok(rows)
    }

    /// Revokes a token; the next request that carries it is refused
    /// (`TOKEN_REVOKED`). Returns whether it was live (false: already revoked).
    pub fn revoke_token(&mut self, id: &str) -> Result<bool, EngineError> {
        let now = self.clock.now_ms();
        let (exists, changed) = self.store.write(|tx| -> Result<_, StoreError> {
            let exists = tx.token(id)?.is_some();
            Ok((exists, exists && tx.revoke_token(id, now)?))
        })?;
        if !exists {
            return Err(EngineError::invalid("NO_SUCH_TOKEN", "no token with that id"));
        }
        Ok(changed)
    }

    /// Resolves the `Authorization` header of one request to its principal,
    /// reading the token's row now (never a cached answer). A refusal writes
    /// only its trace event (`authentication`, with the reason), nothing else.
    pub fn authenticate(
        &mut self,
        authorization: Option<&[u8]>,
    ) -> Result<Result<Principal, AuthFailure>, EngineError> {
        let verdict = match bearer(authorization) {
            Err(f) => Err(f),
            Ok((prefix, secret)) => {
                let row = self.store.read(|tx| tx.token_by_prefix(prefix))?;
                let now = self.clock.now_ms();
                match row {
                    None => Err(AuthFailure::Unknown),
                    Some(row) => {
                        let given = secret_digest(prefix, secret);
                        if !bool::from(given.as_bytes().ct_eq(row.secret_sha256.as_bytes())) {
                            Err(AuthFailure::Unknown)
                        } else if row.revoked_at.is_some() {
                            Err(AuthFailure::Revoked)
                        } else if row.expires_at.is_some_and(|t| now >= t) {
                            Err(AuthFailure::Expired)
                        } else {
                            principal_of(row)
                        }
                    }
                }
            }
        };
        if let Err(f) = verdict {
            let now = self.clock.now_ms();
            // Counted in memory (every one, for the metrics); a sample of at
            // most one a second reaches the ledger, saying how many it stands
            // for: a flood of bad tokens must not grow the ledger.
            if let Some(since) = AUTH_REFUSALS.count(f, now) {
                let mut ev = TraceEvent::step(Step::Authentication);
                ev.reason = Some(f.reason());
                ev.note = Some(format!("sampled: {since} refusal(s) in this process since the last sample"));
                // A refusal changes no state: only how it was answered is recorded.
                self.store.write_relaxed(|tx| ev.write(tx, now))?;
            }
        }
        Ok(verdict)
    }
}

/// This process's authentication refusals: counted by reason in memory
/// (`toolgate_auth_refusals_total`), sampled into the ledger's trace at most
/// once per [`AuthRefusals::SAMPLE_MS`].
#[derive(Debug, Default)]
pub struct AuthRefusals {
    by_reason: [std::sync::atomic::AtomicU64; 5],
    since_sample: std::sync::atomic::AtomicU64,
    last_sample_ms: std::sync::atomic::AtomicI64,
}

/// The process's refusal counters.
pub static AUTH_REFUSALS: AuthRefusals = AuthRefusals {
    by_reason: [const { std::sync::atomic::AtomicU64::new(0) }; 5],
    since_sample: std::sync::atomic::AtomicU64::new(0),
    last_sample_ms: std::sync::atomic::AtomicI64::new(i64::MIN),
};

impl AuthRefusals {
    /// At most one sampled trace row per this many milliseconds.
    pub const SAMPLE_MS: i64 = 1_000;
    const ALL: [AuthFailure; 5] = [
        AuthFailure::Missing,
        AuthFailure::Malformed,
        AuthFailure::Unknown,
        AuthFailure::Expired,
        AuthFailure::Revoked,
    ];

    /// Counts a refusal; `Some(n)` when this one is to be sampled into the
    /// ledger (n: the refusals it stands for, itself included).
    fn count(&self, f: AuthFailure, now: i64) -> Option<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        let i = Self::ALL.iter().position(|x| *x == f).unwrap_or(0);
        self.by_reason[i].fetch_add(1, SeqCst);
        self.since_sample.fetch_add(1, SeqCst);
        let last = self.last_sample_ms.load(SeqCst);
        if now.saturating_sub(last) < Self::SAMPLE_MS
            || self.last_sample_ms.compare_exchange(last, now, SeqCst, SeqCst).is_err()
        {
            return None;
        }
        Some(self.since_sample.swap(0, SeqCst))
    }

    /// (reason, refusals) since the process started.
    pub fn totals(&self) -> Vec<(&'static str, u64)> {
        Self::ALL
            .iter()
            .zip(&self.by_reason)
            .map(|(f, n)| (f.reason().as_str(), n.load(std::sync::atomic::Ordering::SeqCst)))
            .collect()
    }
}

impl Engine {
    /// One operation as a caller sees it (`GET /v1/operations/{id}`), read now.
    /// `scope` is the caller's (tenant, subject): an operation of anyone else
    /// is `None`, exactly like one that does not exist, so an id tells nothing
    /// about other tenants. The caller's current authorization is checked as
    /// for a replay (docs/design.md §5): a revoked subject gets the refusal, never
    /// the stored result. An operator (`scope` none) sees any operation.
    /// Nothing is written.
    pub fn caller_operation(&mut self, id: &str, scope: Option<(&str, &str)>) -> Result<Option<Envelope>, EngineError> {
        let operator_scope = self.operator_scope.clone();
        let toolset = self.toolset.clone();
        let salt = self.salt.clone();
        let found = self.store.read(|tx| -> Result<_, StoreError> {
            let Some(op) = tx.operation(id)? else { return Ok(None) };
            if scope.is_some_and(|(t, s)| op.tenant != t || op.subject != s) {
                return Ok(None);
            }
            if !Engine::in_operator_scope(operator_scope.as_deref(), &op.tenant) {
                return Ok(None);
            }
            let refused = match scope {
                Some(_) if verify_row(&op, &salt).is_ok() => {
                    let domain = toolset.domain(&op.tool);
                    authorize(tx, &*domain, &op.tenant, &op.subject, &op.tool, &args_of(&op.request_json))?
                }
                _ => None,
            };
            let last_code = tx.outbox(&op.id)?.and_then(|o| o.last_code);
            Ok(Some((op, refused, last_code)))
        })?;
        let Some((op, refused, last_code)) = found else { return Ok(None) };
        let principal_ref = self.principal_ref(&op.tenant, &op.subject);
        if verify_row(&op, &self.salt).is_err() {
            // A damaged row is never shown as if it were true.
            let audit =
                ProtectedAudit { operation_id: Some(op.id.clone()), principal_ref, ..ProtectedAudit::default() };
            return Ok(Some(error_envelope(Code::StatusConflict, audit)));
        }
        if let Some(code) = refused {
            let audit = ProtectedAudit { principal_ref, tool: op.tool.clone(), ..ProtectedAudit::default() };
            return Ok(Some(error_envelope(code, audit)));
        }
        Ok(Some(op_envelope(&op, Delivery::LocalReplay, principal_ref, last_code.as_deref())))
    }

    /// Of `tools`, the ones a subject holds an unrevoked grant for, read now
    /// (what an MCP `tools/list` shows an agent).
    pub fn granted_tools(&mut self, tenant: &str, subject: &str, tools: &[String]) -> Result<Vec<String>, EngineError> {
        let granted = self.store.read(|tx| tx.granted_tools(tenant, subject))?;
        Ok(tools.iter().filter(|t| granted.contains(t)).cloned().collect())
    }

    /// The state of an operation, read now (`None`: no such operation).
    pub fn operation_state(&mut self, id: &str) -> Result<Option<crate::store::OpState>, EngineError> {
        Ok(self.store.read(|tx| tx.operation(id))?.map(|o| o.state))
    }
}

fn principal_of(row: TokenRow) -> Result<Principal, AuthFailure> {
    let tenants = row.operator_tenants.map(|t| t.split(',').map(str::to_string).collect());
    match (row.kind.as_str(), row.tenant, row.subject, row.operator) {
        ("subject", Some(tenant), Some(subject), None) => Ok(Principal::Subject { tenant, subject, token_id: row.id }),
        ("operator", None, None, Some(operator)) => Ok(Principal::Operator { operator, token_id: row.id, tenants }),
        // The table's CHECK forbids anything else; a row edited past it is refused.
        _ => Err(AuthFailure::Unknown),
    }
}

#[cfg(test)]
mod tests {
    use super::{bearer, parse_token, AuthFailure};

    fn check(header: Option<&[u8]>, expect: Result<(&str, &str), AuthFailure>) {
        assert_eq!(bearer(header), expect, "{:?}", header.map(String::from_utf8_lossy));
    }

    #[test]
    fn bearer_headers() {
        let secret = "A".repeat(43);
        let good = format!("tgt_0123456789abcdef_{secret}");
        check(None, Err(AuthFailure::Missing));
        check(Some(format!("Bearer {good}").as_bytes()), Ok(("tgt_0123456789abcdef", &secret)));
        check(Some(format!("bearer   {good} ").as_bytes()), Ok(("tgt_0123456789abcdef", &secret)));
        for bad in [
            format!("Basic {good}"),
            good.clone(),
            "Bearer".to_string(),
            "Bearer ".to_string(),
            format!("Bearer {}", &good[..good.len() - 1]),
            format!("Bearer {good}x"),
            format!("Bearer {}", good.replace("0123", "0G23")),
            format!("Bearer {}", good.replace("0123", "0A23")),
            format!("Bearer tgx_{}", &good[4..]),
            format!("Bearer {}", good.replacen('A', "é", 1)),
        ] {
            check(Some(bad.as_bytes()), Err(AuthFailure::Malformed));
        }
        check(Some(b"Bearer \xff\xfe"), Err(AuthFailure::Malformed));
        assert!(parse_token(&format!("tgt_0123456789abcdef-{secret}")).is_none());
    }
}
