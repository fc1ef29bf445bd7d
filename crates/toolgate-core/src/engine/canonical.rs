//! Canonical JSON (RFC 8785), request/result/call-binding digests and the opaque
//! `status_ref` (docs/design.md §3).
//!
//! Canonicalization itself is `serde_json_canonicalizer` (it passes the RFC 8785
//! vectors, see `tests/it/canonical.rs`). What no crate does for us is the strict
//! *parsing* in front of it: `serde_json` silently keeps the last of two duplicate
//! keys, so [`parse_strict`] uses a small hand-written visitor that refuses them.

use std::collections::BTreeMap;
use std::fmt;

use hmac::{Hmac, Mac};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Largest JSON input accepted anywhere (arguments, world files are bigger and use their own).
pub const MAX_INPUT_BYTES: usize = 64 * 1024;
/// Deepest nesting accepted in arguments.
pub const MAX_DEPTH: usize = 32;

/// Why a JSON text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    /// The text is larger than the limit.
    #[error("input is over the {} limit", human_bytes(*limit))]
    TooLarge { limit: usize },
    /// Nested deeper than the limit.
    #[error("input nests deeper than {limit} levels")]
    TooDeep { limit: usize },
    /// The same key twice in one object.
    #[error("duplicate object key {key:?}")]
    DuplicateKey { key: String },
    /// Not JSON (includes NaN/Infinity, lone surrogates, invalid UTF-8).
    #[error("not valid JSON: {0}")]
    Syntax(String),
    /// A number that has no finite IEEE-754 double form.
    #[error("number out of range")]
    NonFinite,
}

/// `64 KiB`, `16 MiB`, or `N bytes`.
fn human_bytes(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// Parses a JSON text strictly: size and depth limits, no duplicate keys, no
/// non-finite numbers, valid UTF-8 and no lone surrogates (serde_json refuses those).
pub fn parse_strict(bytes: &[u8], max_bytes: usize, max_depth: usize) -> Result<Value, CanonicalError> {
    if bytes.len() > max_bytes {
        // Callers stop reading at the limit + 1 byte: how much more there was is not known.
        return Err(CanonicalError::TooLarge { limit: max_bytes });
    }
    // Depth is checked on the raw text before parsing so that a hostile input
    // never reaches a recursive parser deeper than the limit.
    check_depth(bytes, max_depth)?;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = StrictSeed { depth: 0, max_depth }.deserialize(&mut de).map_err(|e| classify(&e))?;
    de.end().map_err(|e| CanonicalError::Syntax(strip_position(&e)))?;
    Ok(value)
}

fn classify(e: &serde_json::Error) -> CanonicalError {
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix("duplicate object key ") {
        let key = rest.split(" at line").next().unwrap_or(rest).trim_matches('"').to_string();
        return CanonicalError::DuplicateKey { key };
    }
    if msg.starts_with("nesting too deep") {
        return CanonicalError::TooDeep { limit: MAX_DEPTH };
    }
    if msg.starts_with("non-finite number") {
        return CanonicalError::NonFinite;
    }
    CanonicalError::Syntax(strip_position(e))
}

fn strip_position(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    match msg.find(" at line ") {
        Some(i) => format!("{} (line {}, column {})", &msg[..i], e.line(), e.column()),
        None => msg,
    }
}

fn check_depth(bytes: &[u8], max_depth: usize) -> Result<(), CanonicalError> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max_depth {
                    return Err(CanonicalError::TooDeep { limit: max_depth });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

struct StrictSeed {
    depth: usize,
    max_depth: usize,
}

impl<'de> DeserializeSeed<'de> for StrictSeed {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(StrictVisitor { depth: self.depth, max_depth: self.max_depth })
    }
}

struct StrictVisitor {
    depth: usize,
    max_depth: usize,
}

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("non-finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let depth = self.enter::<A::Error>()?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictSeed { depth, max_depth: self.max_depth })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let depth = self.enter::<A::Error>()?;
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate object key {key:?}")));
            }
            let v = map.next_value_seed(StrictSeed { depth, max_depth: self.max_depth })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

impl StrictVisitor {
    fn enter<E: de::Error>(&self) -> Result<usize, E> {
        if self.depth + 1 > self.max_depth {
            return Err(E::custom("nesting too deep"));
        }
        Ok(self.depth + 1)
    }
}

/// The RFC 8785 canonical form of a value.
///
/// Every call pays for this (request digests, bindings, results, trace events,
/// and re-checking stored rows), and `serde_json_canonicalizer` is slow at the
/// structural part: it re-parses each object key to sort it. So the structure
/// is written here, and every number that is not a safe integer goes to the
/// crate: ECMAScript number formatting, the part of RFC 8785 worth a maintained
/// implementation, stays the crate's. What is left is small and checked against
/// the crate by a property test (`tests::agrees_with_the_crate`): members sorted
/// by UTF-16 code units, strings escaped as RFC 8785 §3.2.2.2 says (`"` `\`,
/// the five short control escapes, other controls as lower-case `\u00hh`,
/// nothing else), integers up to 2^53 in magnitude in plain decimal (what
/// ECMAScript prints for them).
pub fn canonical_string(value: &Value) -> String {
    let mut out = String::with_capacity(256);
    write_canonical(value, &mut out);
    out
}

/// The crate's canonical form of a whole value (the reference the fast writer
/// is tested against).
#[cfg(test)]
fn crate_canonical(value: &Value) -> String {
    // serde_json_canonicalizer only fails on values serde_json cannot represent
    // (non-string keys, non-finite floats), which a `Value` never holds.
    serde_json_canonicalizer::to_string(value).unwrap_or_else(|_| value.to_string())
}

/// Largest integer magnitude an IEEE-754 double holds exactly (2^53).
const MAX_SAFE_INTEGER: u64 = 1 << 53;

fn write_canonical(value: &Value, out: &mut String) {
    use std::fmt::Write as _;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64().filter(|i| i.unsigned_abs() <= MAX_SAFE_INTEGER) {
                let _ = write!(out, "{i}");
            } else if let Some(u) = n.as_u64().filter(|u| *u <= MAX_SAFE_INTEGER) {
                let _ = write!(out, "{u}");
            } else {
                out.push_str(&serde_json_canonicalizer::to_string(n).unwrap_or_else(|_| n.to_string()));
            }
        }
        Value::String(s) => write_canonical_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| utf16_order(a.0, b.0));
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical_str(k, out);
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
    }
}

/// Writes one JSON object in RFC 8785 form member by member, for hot paths
/// that know their members and would otherwise build a `Value` tree only to
/// canonicalize it. The caller gives the members in canonical key order
/// (checked in debug builds); absent optional members are left out, as
/// `skip_serializing_if` leaves them out of the tree. Callers test their
/// output equal to `canonical_string(&to_value(..))`.
pub(crate) struct ObjectWriter<'a> {
    out: &'a mut String,
    last: Option<&'static str>,
}

impl<'a> ObjectWriter<'a> {
    /// Opens an object.
    pub(crate) fn new(out: &'a mut String) -> Self {
        out.push('{');
        Self { out, last: None }
    }

    fn key(&mut self, k: &'static str) -> &mut String {
        debug_assert!(
            self.last.is_none_or(|l| utf16_order(l, k) == std::cmp::Ordering::Less),
            "member {k} written out of canonical order"
        );
        if self.last.is_some() {
            self.out.push(',');
        }
        self.last = Some(k);
        write_canonical_str(k, self.out);
        self.out.push(':');
        self.out
    }

    /// A string member, if present.
    pub(crate) fn str(&mut self, k: &'static str, v: Option<&str>) {
        if let Some(v) = v {
            let out = self.key(k);
            write_canonical_str(v, out);
        }
    }

    /// An integer member, if present.
    pub(crate) fn int(&mut self, k: &'static str, v: Option<i64>) {
        if let Some(v) = v {
            let out = self.key(k);
            write_canonical(&Value::from(v), out);
        }
    }

    /// An unsigned integer member, if present.
    pub(crate) fn uint(&mut self, k: &'static str, v: Option<u64>) {
        if let Some(v) = v {
            let out = self.key(k);
            write_canonical(&Value::from(v), out);
        }
    }

    /// A boolean member, if present.
    pub(crate) fn bool(&mut self, k: &'static str, v: Option<bool>) {
        if let Some(v) = v {
            self.key(k).push_str(if v { "true" } else { "false" });
        }
    }

    /// An array of strings, left out when empty.
    pub(crate) fn strs(&mut self, k: &'static str, v: &[&str]) {
        if v.is_empty() {
            return;
        }
        let out = self.key(k);
        out.push('[');
        for (i, s) in v.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_canonical_str(s, out);
        }
        out.push(']');
    }

    /// A nested object, if present, its members written by `f`.
    pub(crate) fn object<T>(&mut self, k: &'static str, v: Option<T>, f: impl FnOnce(&mut ObjectWriter<'_>, T)) {
        if let Some(v) = v {
            let out = self.key(k);
            let mut inner = ObjectWriter::new(out);
            f(&mut inner, v);
            inner.end();
        }
    }

    /// Closes the object.
    pub(crate) fn end(self) {
        self.out.push('}');
    }
}

/// RFC 8785 member order: by UTF-16 code units (byte order agrees for ASCII).
fn utf16_order(a: &str, b: &str) -> std::cmp::Ordering {
    if a.is_ascii() && b.is_ascii() {
        a.cmp(b)
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

/// An RFC 8785 string (§3.2.2.2).
fn write_canonical_str(s: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x09 => "\\t",
            0x0a => "\\n",
            0x0c => "\\f",
            0x0d => "\\r",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[plain..i]);
        if escape.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(escape);
        }
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
    out.push('"');
}

/// Canonicalizes a JSON text (strict parse, then RFC 8785).
pub fn canonicalize_text(text: &[u8]) -> Result<String, CanonicalError> {
    let v = parse_strict(text, usize::MAX, 256)?;
    Ok(canonical_string(&v))
}

/// Lower-case hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex_lower(&Sha256::digest(bytes))
}

/// Lower-case hex of bytes.
pub fn hex_lower(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// `prefix_` and the lower-case hex of bytes (an id).
pub fn prefixed_hex(prefix: &str, bytes: &[u8]) -> String {
    let mut out = String::with_capacity(prefix.len() + 1 + bytes.len() * 2);
    out.push_str(prefix);
    out.push('_');
    push_hex(&mut out, bytes);
    out
}

/// Appends the lower-case hex of bytes, through `hex::encode_to_slice` and a
/// stack buffer: `hex::encode` builds its `String` one `char` at a time,
/// several times the instructions, and a fresh dispatch hexes about a dozen
/// digests and ids (callgrind).
fn push_hex(out: &mut String, bytes: &[u8]) {
    let mut buf = [0u8; 64];
    for chunk in bytes.chunks(buf.len() / 2) {
        let digits = &mut buf[..chunk.len() * 2];
        // Cannot fail: the buffer is exactly twice the input, and hex is ASCII.
        if hex::encode_to_slice(chunk, digits).is_ok() {
            out.push_str(std::str::from_utf8(digits).unwrap_or_default());
        }
    }
}

/// SHA-256 of the canonical form of a value.
pub fn digest_value(value: &Value) -> String {
    sha256_hex(canonical_string(value).as_bytes())
}

/// The contract revisions a request was made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Revisions {
    /// Input schema revision.
    pub input: i64,
    /// Output schema revision.
    pub output: i64,
    /// Effect (semantics) revision.
    pub effect: i64,
}

/// The canonical request object whose digest is `request_sha256`. It excludes the
/// call id, operation id and idempotency key on purpose (docs/design.md §3).
pub fn request_object(tenant: &str, subject: &str, tool: &str, arguments: &Value, rev: Revisions) -> Value {
    serde_json::json!({
        "tenant": tenant,
        "subject": subject,
        "tool": tool,
        "arguments": arguments,
        "revisions": {"input": rev.input, "output": rev.output, "effect": rev.effect},
    })
}

/// The call identity of one provider call (docs/design.md §2).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CallIdentity {
    /// Model provider, e.g. `openai`.
    pub provider: String,
    /// API family, e.g. `responses`.
    pub api_family: String,
    /// Provider response id.
    pub response_id: String,
    /// Provider call id.
    pub call_id: String,
    /// Adapter revision.
    pub adapter_revision: String,
}

impl CallIdentity {
    /// The ledger key of this call identity for one principal: the one place a
    /// `CallKey` is built from a call identity.
    pub fn key<'a>(&'a self, tenant: &'a str, subject: &'a str) -> crate::store::CallKey<'a> {
        crate::store::CallKey {
            tenant,
            subject,
            provider: &self.provider,
            api_family: &self.api_family,
            response_id: &self.response_id,
            call_id: &self.call_id,
        }
    }
}

/// Everything `call_binding_sha256` covers (docs/design.md §3).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BindingInput<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Subject.
    pub subject: &'a str,
    /// The call identity.
    pub call: &'a CallIdentity,
    /// Operation id.
    pub operation_id: &'a str,
    /// The idempotency key itself (so a package cannot move to another key).
    pub idempotency_key: &'a str,
    /// Contract revisions.
    pub revisions: Revisions,
    /// Request digest.
    pub request_sha256: &'a str,
    /// Result digest, once a result exists.
    pub result_sha256: Option<&'a str>,
    /// Downstream request id, once known.
    pub downstream_request_id: Option<&'a str>,
    /// Downstream receipt id, once known.
    pub receipt_id: Option<&'a str>,
    /// The opaque status reference.
    pub status_ref: &'a str,
}

/// `call_binding_sha256` over a [`BindingInput`]: the SHA-256 of its
/// canonical JSON, written field by field in the canonical key order rather
/// than through a `Value` tree (every call computes it; the tree cost more
/// than the digest). Tested equal to `digest_value(&to_value(b))`.
pub fn call_binding_sha256(b: &BindingInput<'_>) -> String {
    let mut out = String::with_capacity(768);
    write_binding(b, &mut out);
    sha256_hex(out.as_bytes())
}

/// The canonical form of a [`BindingInput`]: keys in code-unit order (all
/// ASCII here), `null` for an absent value, integers as [`write_canonical`]
/// writes them.
fn write_binding(b: &BindingInput<'_>, out: &mut String) {
    fn key(out: &mut String, first: bool, k: &str) {
        out.push_str(if first { "{\"" } else { ",\"" });
        out.push_str(k);
        out.push_str("\":");
    }
    fn opt(out: &mut String, v: Option<&str>) {
        match v {
            Some(s) => write_canonical_str(s, out),
            None => out.push_str("null"),
        }
    }
    fn int(out: &mut String, i: i64) {
        write_canonical(&Value::from(i), out);
    }
    let c = b.call;
    key(out, true, "call");
    key(out, true, "adapter_revision");
    write_canonical_str(&c.adapter_revision, out);
    key(out, false, "api_family");
    write_canonical_str(&c.api_family, out);
    key(out, false, "call_id");
    write_canonical_str(&c.call_id, out);
    key(out, false, "provider");
    write_canonical_str(&c.provider, out);
    key(out, false, "response_id");
    write_canonical_str(&c.response_id, out);
    out.push('}');
    key(out, false, "downstream_request_id");
    opt(out, b.downstream_request_id);
    key(out, false, "idempotency_key");
    write_canonical_str(b.idempotency_key, out);
    key(out, false, "operation_id");
    write_canonical_str(b.operation_id, out);
    key(out, false, "receipt_id");
    opt(out, b.receipt_id);
    key(out, false, "request_sha256");
    write_canonical_str(b.request_sha256, out);
    key(out, false, "result_sha256");
    opt(out, b.result_sha256);
    key(out, false, "revisions");
    key(out, true, "effect");
    int(out, b.revisions.effect);
    key(out, false, "input");
    int(out, b.revisions.input);
    key(out, false, "output");
    int(out, b.revisions.output);
    out.push('}');
    key(out, false, "status_ref");
    write_canonical_str(b.status_ref, out);
    key(out, false, "subject");
    write_canonical_str(b.subject, out);
    key(out, false, "tenant");
    write_canonical_str(b.tenant, out);
    out.push('}');
}

/// Sorted map helper for stable JSON objects.
pub type Fields = BTreeMap<String, Value>;

type HmacSha256 = Hmac<Sha256>;

const STATUS_REF_PREFIX: &str = "sr1_";
const NONCE_HEX: usize = 32;
const MAC_HEX: usize = 32;
/// Length of every valid status_ref.
pub const STATUS_REF_LEN: usize = STATUS_REF_PREFIX.len() + NONCE_HEX + MAC_HEX;

/// Why a status_ref was refused (before any lookup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StatusRefError {
    /// Wrong length, prefix or alphabet.
    #[error("malformed status_ref")]
    Malformed,
    /// Well-formed but the MAC does not verify.
    #[error("status_ref does not verify")]
    Forged,
}

/// Mints `status_ref` values and checks them, under a per-database secret.
#[derive(Clone)]
pub struct StatusRefKey {
    secret: Vec<u8>,
}

impl fmt::Debug for StatusRefKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusRefKey(..)")
    }
}

impl StatusRefKey {
    /// A key from the database's secret bytes.
    pub fn new(secret: &[u8]) -> Self {
        Self { secret: secret.to_vec() }
    }

    fn mac(&self, nonce_hex: &str) -> [u8; 16] {
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.secret).unwrap_or_else(|_| {
            // HMAC accepts keys of any length; this branch cannot run.
            <HmacSha256 as Mac>::new_from_slice(b"0").expect("hmac key")
        });
        mac.update(b"toolgate status_ref v1\0");
        mac.update(nonce_hex.as_bytes());
        let full = mac.finalize().into_bytes();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        out
    }

    /// A fresh status_ref from 16 random bytes. It carries no tenant or subject.
    pub fn mint(&self, nonce: [u8; 16]) -> String {
        let nonce_hex = hex_lower(&nonce);
        let mac = hex_lower(&self.mac(&nonce_hex));
        format!("{STATUS_REF_PREFIX}{nonce_hex}{mac}")
    }

    /// Strict check: exact format, then a constant-time MAC comparison.
    pub fn verify(&self, s: &str) -> Result<(), StatusRefError> {
        if s.len() != STATUS_REF_LEN || !s.starts_with(STATUS_REF_PREFIX) {
            return Err(StatusRefError::Malformed);
        }
        let body = &s[STATUS_REF_PREFIX.len()..];
        if !body.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(StatusRefError::Malformed);
        }
        let (nonce_hex, mac_hex) = body.split_at(NONCE_HEX);
        let Ok(given) = hex::decode(mac_hex) else {
            return Err(StatusRefError::Malformed);
        };
        let expected = self.mac(nonce_hex);
        if bool::from(expected.as_slice().ct_eq(given.as_slice())) {
            Ok(())
        } else {
            Err(StatusRefError::Forged)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_hex_encode_at_every_length() {
        let bytes: Vec<u8> = (0..=255u8).cycle().take(100).collect();
        for n in 0..bytes.len() {
            assert_eq!(hex_lower(&bytes[..n]), hex::encode(&bytes[..n]), "{n} bytes");
            assert_eq!(prefixed_hex("id", &bytes[..n]), format!("id_{}", hex::encode(&bytes[..n])));
        }
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[allow(clippy::needless_pass_by_value)]
    fn check(input: &str, expect: Result<&str, CanonicalError>) {
        let got = parse_strict(input.as_bytes(), MAX_INPUT_BYTES, MAX_DEPTH).map(|v| canonical_string(&v));
        assert_eq!(got.as_deref().map_err(Clone::clone), expect, "input: {input}");
    }

    #[test]
    fn strict_parse() {
        check(r#"{"b":1,"a":[1.0,2e3]}"#, Ok(r#"{"a":[1,2000],"b":1}"#));
        check(r#"{"a":1,"a":2}"#, Err(CanonicalError::DuplicateKey { key: "a".into() }));
        check(r#"{"x":{"a":1,"a":1}}"#, Err(CanonicalError::DuplicateKey { key: "a".into() }));
        check(r#"{"a": NaN}"#, Err(CanonicalError::Syntax("expected value (line 1, column 7)".into())));
        check(&"[".repeat(33), Err(CanonicalError::TooDeep { limit: MAX_DEPTH }));
        check(r#"["[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]"#, Ok(r#"["[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]"#));
        assert!(matches!(parse_strict(br#""\ud800""#, 100, 4), Err(CanonicalError::Syntax(_))));
        assert!(matches!(parse_strict(b"\"\xff\"", 100, 4), Err(CanonicalError::Syntax(_))));
        assert!(matches!(parse_strict(b"1e999", 100, 4), Err(CanonicalError::Syntax(_) | CanonicalError::NonFinite)));
        assert_eq!(parse_strict(&[b' '; 11], 10, 4), Err(CanonicalError::TooLarge { limit: 10 }));
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        // Strings and keys with controls, quotes, backslashes, non-ASCII, and
        // characters on both sides of the UTF-16 surrogate range (where byte
        // order and UTF-16 order disagree).
        let text = proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('/'),
                Just('\u{7f}'),
                Just('\u{e9}'),
                Just('\u{ff5e}'),
                Just('\u{1f600}'),
                Just('\u{10437}'),
                (0u32..0x20).prop_map(|c| char::from_u32(c).unwrap_or('x')),
                proptest::char::range('a', 'e'),
            ],
            0..6,
        )
        .prop_map(|cs| cs.into_iter().collect::<String>());
        let number = prop_oneof![
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-(1i64 << 54)..(1i64 << 54)).prop_map(Value::from),
            any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f).map(Value::Number)),
            (-1e6f64..1e6).prop_filter_map("finite", |f| serde_json::Number::from_f64(f).map(Value::Number)),
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            number,
            text.clone().prop_map(Value::String)
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec((text.clone(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The fast writer and `serde_json_canonicalizer` agree on every value.
        #[test]
        fn agrees_with_the_crate(v in json_value()) {
            proptest::prop_assert_eq!(canonical_string(&v), crate_canonical(&v));
        }

        /// The binding written field by field is the canonical form of the
        /// binding as a JSON value, for any strings (escapes, non-ASCII),
        /// absent or present optional parts, and any revisions.
        #[test]
        fn the_binding_writer_is_the_canonical_value(
            parts in proptest::collection::vec("\\PC{0,12}|[\\x00-\\x1f\"\\\\]{0,3}", 12),
            present in proptest::collection::vec(proptest::bool::ANY, 3),
            revs in proptest::collection::vec(proptest::num::i64::ANY, 3),
        ) {
            let call = CallIdentity {
                provider: parts[0].clone(),
                api_family: parts[1].clone(),
                response_id: parts[2].clone(),
                call_id: parts[3].clone(),
                adapter_revision: parts[4].clone(),
            };
            let b = BindingInput {
                tenant: &parts[5],
                subject: &parts[6],
                call: &call,
                operation_id: &parts[7],
                idempotency_key: &parts[8],
                revisions: Revisions { input: revs[0], output: revs[1], effect: revs[2] },
                request_sha256: &parts[9],
                result_sha256: present[0].then_some(parts[10].as_str()),
                downstream_request_id: present[1].then_some(parts[11].as_str()),
                receipt_id: present[2].then_some(parts[0].as_str()),
                status_ref: &parts[1],
            };
            let mut fast = String::new();
            write_binding(&b, &mut fast);
            let value = serde_json::to_value(&b).unwrap();
            proptest::prop_assert_eq!(&fast, &crate_canonical(&value));
            proptest::prop_assert_eq!(call_binding_sha256(&b), digest_value(&value));
        }
    }

    #[test]
    fn status_ref_round_trip_and_mutation() {
        let k = StatusRefKey::new(b"secret");
        let s = k.mint([7; 16]);
        assert_eq!(s.len(), STATUS_REF_LEN);
        assert_eq!(k.verify(&s), Ok(()));
        let mut bytes = s.clone().into_bytes();
        let last = bytes.len() - 1;
        bytes[last] = if bytes[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(k.verify(&String::from_utf8(bytes).unwrap()), Err(StatusRefError::Forged));
        assert_eq!(k.verify("sr1_"), Err(StatusRefError::Malformed));
        assert_eq!(k.verify(&s.to_uppercase()), Err(StatusRefError::Malformed));
        assert_eq!(StatusRefKey::new(b"other").verify(&s), Err(StatusRefError::Forged));
    }
}
