//! What every step knows about a stored operation or approval: its call
//! identity, binding, envelope, the checks that find a tampered row, and how a
//! fresh row is made. Admission (`dispatch`), the worker, the reaper and
//! recovery all stand on this module; it imports none of them.

use serde_json::{json, Value};

use super::canonical::{
    call_binding_sha256, canonical_string, digest_value, parse_strict, sha256_hex, BindingInput, CallIdentity,
    Revisions,
};
use super::contracts::Contract;
use super::envelope::{
    Binding, Code, Delivery, Downstream as DownstreamInfo, Envelope, ErrorInfo, Execution, ModelResult, Outcome,
    ProtectedAudit, Status,
};
use super::tool::{Receipt, ToolCall, ToolDomain};
use crate::store::Scope;
use crate::store::{Access, ApprovalRow, OpState, OperationRow, StoreError, Tx};

/// The business intent a downstream effect is counted under: the whole scope
/// (tenant, subject, tool, caller's key), hashed.
pub fn intent_of(scope: Scope<'_>) -> String {
    let Scope { tenant, subject, tool, key: caller_key } = scope;
    sha256_hex(format!("{tenant}\0{subject}\0{tool}\0{caller_key}").as_bytes())
}

/// The arguments of a stored canonical request (`Null` if it does not parse:
/// `verify_row` refuses such a row before anything uses them).
pub(crate) fn args_of(request_json: &str) -> Value {
    serde_json::from_str::<Value>(request_json).ok().and_then(|r| r.get("arguments").cloned()).unwrap_or(Value::Null)
}

/// The call binding of an operation row as it stands.
pub(crate) fn binding_of(op: &OperationRow) -> String {
    Checked::of(op).binding()
}

pub(crate) fn revisions_of(op: &OperationRow) -> Revisions {
    Revisions { input: op.input_rev, output: op.output_rev, effect: op.effect_rev }
}

/// Recomputes a row's digests and binding: any mismatch is tampering (docs/design.md §3).
/// The checks every stored copy of a bound request shares (an operation, an
/// approval): tenant, subject and tool as the request says, the contract
/// revisions it was bound under, and the key digest recomputed.
pub(crate) fn check_restated(
    request: &Value,
    [tenant, subject, tool]: [&str; 3],
    revisions: [i64; 3],
    idem_key: &str,
    key_sha256: &str,
) -> Result<(), &'static str> {
    let said = |field: &str| request.get(field).and_then(Value::as_str);
    if said("tenant") != Some(tenant) {
        return Err("tenant does not match the bound request");
    }
    if said("subject") != Some(subject) {
        return Err("subject does not match the bound request");
    }
    if said("tool") != Some(tool) {
        return Err("tool does not match the bound request");
    }
    let rev = |k: &str| request.get("revisions").and_then(|r| r.get(k)).and_then(Value::as_i64);
    if [rev("input"), rev("output"), rev("effect")] != revisions.map(Some) {
        return Err("contract revisions do not match the bound request");
    }
    if sha256_hex(idem_key.as_bytes()) != key_sha256 {
        return Err("key_sha256 does not recompute");
    }
    Ok(())
}

/// The call identity an approval request holds (the call it would run).
pub(crate) fn approval_call(a: &ApprovalRow) -> CallIdentity {
    CallIdentity {
        provider: a.call_provider.clone(),
        api_family: a.call_api_family.clone(),
        response_id: a.call_response_id.clone(),
        call_id: a.call_id.clone(),
        adapter_revision: a.adapter_revision.clone(),
    }
}

/// The call identity an operation row holds.
pub(crate) fn call_of(op: &OperationRow) -> CallIdentity {
    CallIdentity {
        provider: op.call_provider.clone(),
        api_family: op.call_api_family.clone(),
        response_id: op.call_response_id.clone(),
        call_id: op.call_id.clone(),
        adapter_revision: op.adapter_revision.clone(),
    }
}

/// The columns of an operation row that [`verify_row_afresh`] reads, and
/// nothing else: the checks are written against this view, so they are a
/// pure function of these columns by construction, and [`Checked::digest`]
/// (a SHA-256 over exactly these columns) decides whether a row is one this
/// thread has verified before. Columns that only move with the row's life
/// (version, timestamps, code, approval, resolution) are not checked, so a
/// new state of an intact row stays verified.
struct Checked<'a> {
    id: &'a str,
    state: &'a str,
    tenant: &'a str,
    subject: &'a str,
    tool: &'a str,
    idem_key: &'a str,
    key_sha256: &'a str,
    request_sha256: &'a str,
    request_json: &'a str,
    revisions: [i64; 3],
    status_ref: &'a str,
    downstream_key: &'a str,
    result_json: Option<&'a str>,
    result_sha256: Option<&'a str>,
    downstream_request_id: Option<&'a str>,
    receipt_id: Option<&'a str>,
    call_binding_sha256: &'a str,
    call: [&'a str; 5],
}

impl<'a> Checked<'a> {
    fn of(op: &'a OperationRow) -> Self {
        Checked {
            id: &op.id,
            state: op.state.as_str(),
            tenant: &op.tenant,
            subject: &op.subject,
            tool: &op.tool,
            idem_key: &op.idem_key,
            key_sha256: &op.key_sha256,
            request_sha256: &op.request_sha256,
            request_json: &op.request_json,
            revisions: [op.input_rev, op.output_rev, op.effect_rev],
            status_ref: &op.status_ref,
            downstream_key: &op.downstream_key,
            result_json: op.result_json.as_deref(),
            result_sha256: op.result_sha256.as_deref(),
            downstream_request_id: op.downstream_request_id.as_deref(),
            receipt_id: op.receipt_id.as_deref(),
            call_binding_sha256: &op.call_binding_sha256,
            call: [&op.call_provider, &op.call_api_family, &op.call_response_id, &op.call_id, &op.adapter_revision],
        }
    }

    /// The call binding these columns recompute to.
    fn binding(&self) -> String {
        let [provider, api_family, response_id, call_id, adapter_revision] = self.call.map(str::to_string);
        let call = CallIdentity { provider, api_family, response_id, call_id, adapter_revision };
        let [input, output, effect] = self.revisions;
        call_binding_sha256(&BindingInput {
            tenant: self.tenant,
            subject: self.subject,
            call: &call,
            operation_id: self.id,
            idempotency_key: self.idem_key,
            revisions: Revisions { input, output, effect },
            request_sha256: self.request_sha256,
            result_sha256: self.result_sha256,
            downstream_request_id: self.downstream_request_id,
            receipt_id: self.receipt_id,
            status_ref: self.status_ref,
        })
    }

    /// SHA-256 over every column of the view, each length-prefixed (an
    /// absent one marked apart from an empty one): equal digests, equal views.
    fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut text = |t: Option<&str>| match t {
            Some(t) => {
                h.update([1]);
                h.update((t.len() as u64).to_le_bytes());
                h.update(t.as_bytes());
            }
            None => h.update([0]),
        };
        for t in [self.id, self.state, self.tenant, self.subject, self.tool, self.idem_key, self.key_sha256] {
            text(Some(t));
        }
        for t in [self.request_sha256, self.request_json, self.status_ref, self.downstream_key] {
            text(Some(t));
        }
        for t in [self.result_json, self.result_sha256, self.downstream_request_id, self.receipt_id] {
            text(t);
        }
        text(Some(self.call_binding_sha256));
        for t in self.call {
            text(Some(t));
        }
        for r in self.revisions {
            h.update(r.to_le_bytes());
        }
        h.finalize().into()
    }
}

/// Rows this thread has verified (or built itself), one slot per hash of the
/// operation id, holding the [`Checked::digest`] of the row that verified: a
/// row whose checked columns are unchanged needs no second parse,
/// canonicalization and digests (a replay reads the same row again, usually
/// soon). Any change to a checked column, tampered or not, misses and is
/// verified again. 16,384 slots of 32 bytes: 512 KiB per engine thread (the
/// server runs a fixed pool of them). With 4,096 slots, a bench cycling over
/// 5,000 settled intents found its row in the memo about one replay in four.
const VERIFIED_SLOTS: usize = 16384;

thread_local! {
    static VERIFIED: std::cell::RefCell<Vec<Option<[u8; 32]>>> =
        std::cell::RefCell::new(vec![None; VERIFIED_SLOTS]);
}

fn verified_slot(id: &str) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    (h.finish() % VERIFIED_SLOTS as u64) as usize
}

/// Checks a stored row against what binds it; `ledger` is the ledger's salt
/// (the downstream key is derived under it).
pub(crate) fn verify_row(op: &OperationRow, ledger: &str) -> Result<(), &'static str> {
    let checked = Checked::of(op);
    let digest = checked.digest();
    let slot = verified_slot(&op.id);
    if VERIFIED.with(|v| v.borrow()[slot] == Some(digest)) {
        return Ok(());
    }
    verify_checked(&checked, ledger)?;
    VERIFIED.with(|v| v.borrow_mut()[slot] = Some(digest));
    Ok(())
}

/// Remembers a row this engine has just built and written (a persisted
/// result), so that reading it back (the replays that follow) needs no
/// second verification; a later change of a checked column by anyone else
/// misses. (The claim in an accept's own transaction does not read the new
/// row back at all: `Decision::Execute` with its built row, in `dispatch`.) Only rows built
/// here, never rows read from storage; debug builds (the tests) still verify
/// it, so a construction bug is caught.
pub(crate) fn remember_built(op: &OperationRow, ledger: &str) {
    debug_assert_eq!(
        verify_row_afresh(op, ledger),
        Ok(()),
        "the engine built a row that fails its own integrity check"
    );
    let digest = Checked::of(op).digest();
    VERIFIED.with(|v| v.borrow_mut()[verified_slot(&op.id)] = Some(digest));
}

/// Every check of [`verify_row`], never remembered.
pub(crate) fn verify_row_afresh(op: &OperationRow, ledger: &str) -> Result<(), &'static str> {
    verify_checked(&Checked::of(op), ledger)
}

/// The checks, on the checked columns alone.
fn verify_checked(op: &Checked<'_>, ledger: &str) -> Result<(), &'static str> {
    let parse_canonical =
        |text: &str| parse_strict(text.as_bytes(), usize::MAX, 256).ok().filter(|v| canonical_string(v) == text);
    if !matches!(op.state, "accepted" | "in_flight" | "succeeded" | "failed" | "unknown" | "needs_review" | "resolved")
    {
        return Err("state is not a ledger state");
    }
    let Some(request) = parse_canonical(op.request_json) else {
        return Err("request_json is not canonical");
    };
    if sha256_hex(op.request_json.as_bytes()) != op.request_sha256 {
        return Err("request_sha256 does not recompute");
    }
    // Every column that restates the bound request must agree with it: the
    // scope columns decide which row a replay finds, the revisions which
    // contract it is checked against.
    check_restated(&request, [op.tenant, op.subject, op.tool], op.revisions, op.idem_key, op.key_sha256)?;
    match (op.result_json, op.result_sha256) {
        (Some(r), Some(h)) => {
            if parse_canonical(r).is_none() {
                return Err("result_json is not canonical");
            }
            if sha256_hex(r.as_bytes()) != h {
                return Err("result_sha256 does not recompute");
            }
        }
        (None, None) => {}
        _ => return Err("result and result digest disagree"),
    }
    // The state must agree with the row's own evidence: a row that holds the
    // provider's receipt and a result is not one that "had no effect" or
    // "never ran", and a success without them is not a success.
    let evidence = op.receipt_id.is_some() && op.result_json.is_some();
    match op.state {
        "failed" | "accepted" if op.receipt_id.is_some() || op.downstream_request_id.is_some() => {
            return Err("state contradicts the row's own receipt");
        }
        "succeeded" if !evidence => return Err("succeeded without its receipt and result"),
        _ => {}
    }
    if op.binding() != op.call_binding_sha256 {
        return Err("call_binding_sha256 does not recompute");
    }
    // A derived key must recompute; a key of an older shape is only valid on a
    // row written before that shape was replaced (the audit checks which rows
    // those are: `dk_` random keys before migration 0009, `dk2_` keys derived
    // from the operation before migration 0015).
    let recomputes = if op.downstream_key.starts_with("dk3_") {
        op.downstream_key == downstream_key_of(ledger, [op.tenant, op.subject, op.tool], op.idem_key)
    } else if op.downstream_key.starts_with("dk2_") {
        op.downstream_key == operation_downstream_key(op.id, op.status_ref)
    } else {
        op.downstream_key.starts_with("dk_")
    };
    if !recomputes {
        return Err("downstream_key does not recompute");
    }
    Ok(())
}

/// The envelope a caller gets for an operation in its current state.
pub(crate) fn op_envelope(
    op: &OperationRow,
    delivery: Delivery,
    principal_ref: String,
    last_code: Option<&str>,
) -> Envelope {
    let call = call_of(op);
    let audit = ProtectedAudit {
        operation_id: Some(op.id.clone()),
        principal_ref,
        provider: Some(call),
        tool: op.tool.clone(),
        revisions: Some(revisions_of(op)),
        binding: Binding {
            request_sha256: Some(op.request_sha256.clone()),
            result_sha256: op.result_sha256.clone(),
            call_binding_sha256: Some(op.call_binding_sha256.clone()),
        },
        downstream: DownstreamInfo {
            request_id: op.downstream_request_id.clone(),
            receipt_id: op.receipt_id.clone(),
            status_ref: Some(op.status_ref.clone()),
        },
        approval_id: op.approval_id.clone(),
    };
    // A copy parsed from the stored text: mutating it cannot change later replays.
    let data = op.result_json.as_deref().and_then(|r| serde_json::from_str::<Value>(r).ok());
    let stored_code = op.code.as_deref().and_then(Code::parse);
    let (status, data, error, outcome, delivery) = match op.state {
        OpState::Succeeded => (Status::Succeeded, data, None, Outcome::Committed, delivery),
        OpState::Failed => {
            let code = stored_code.unwrap_or(Code::BusinessRuleViolation);
            (Status::Failed, None, Some(ErrorInfo::new(code)), Outcome::NotStarted, delivery)
        }
        OpState::Resolved => match op.resolution.as_deref() {
            Some("succeeded") => (Status::Succeeded, data, None, Outcome::Committed, Delivery::HumanResolved),
            Some("compensated") => (Status::Failed, data, None, Outcome::Committed, Delivery::HumanResolved),
            // A person's "failed" is a decision, not proof that nothing was
            // started: the outcome stays unknown, and the data says who decided.
            _ => (Status::Failed, data, None, Outcome::Unknown, Delivery::HumanResolved),
        },
        OpState::Accepted => {
            let code = last_code.and_then(Code::parse).filter(|c| c.retryable()).unwrap_or(Code::TimeoutBeforeExecute);
            (Status::Failed, None, Some(ErrorInfo::new(code)), Outcome::NotStarted, delivery)
        }
        OpState::NeedsReview => {
            let code = stored_code.filter(|c| c.catalog().1 == Outcome::Unknown).unwrap_or(Code::StatusConflict);
            (Status::Unknown, None, Some(ErrorInfo::new(code)), Outcome::Unknown, delivery)
        }
        _ => {
            // in_flight, unknown: never execute again, never reconcile implicitly.
            let code = stored_code.filter(|c| c.catalog().1 == Outcome::Unknown).unwrap_or(Code::OutcomeUnknown);
            (Status::Unknown, None, Some(ErrorInfo::new(code)), Outcome::Unknown, delivery)
        }
    };
    Envelope {
        model_result: ModelResult { status, data, error, execution: Execution { outcome, delivery } },
        protected_audit: audit,
    }
}

/// A fresh ledger row for an accepted call (from a dispatch or an approval).
#[allow(clippy::too_many_arguments)]
pub(crate) fn new_operation_for(
    [tenant, subject, tool]: [&str; 3],
    contract: &Contract,
    call: &CallIdentity,
    key: &str,
    key_sha256: &str,
    request_json: &str,
    request_sha256: &str,
    now: i64,
    deadline_ms: u64,
    refs: &super::canonical::StatusRefKey,
    ids: &super::ids::Ids,
    approval_id: Option<&str>,
    ledger: &str,
) -> OperationRow {
    let mut op = OperationRow {
        id: ids.id("op"),
        tenant: tenant.to_string(),
        subject: subject.to_string(),
        tool: tool.to_string(),
        idem_key: key.to_string(),
        key_sha256: key_sha256.to_string(),
        request_sha256: request_sha256.to_string(),
        request_json: request_json.to_string(),
        input_rev: contract.revisions.input,
        output_rev: contract.revisions.output,
        effect_rev: contract.revisions.effect,
        effect: contract.effect.as_str().to_string(),
        state: OpState::Accepted,
        version: 1,
        status_ref: refs.mint(ids.bytes::<16>()),
        downstream_key: downstream_key_of(ledger, [tenant, subject, tool], key),
        code: None,
        result_json: None,
        result_sha256: None,
        downstream_request_id: None,
        receipt_id: None,
        call_binding_sha256: String::new(),
        call_provider: call.provider.clone(),
        call_api_family: call.api_family.clone(),
        call_response_id: call.response_id.clone(),
        call_id: call.call_id.clone(),
        adapter_revision: call.adapter_revision.clone(),
        approval_id: approval_id.map(str::to_string),
        resolution: None,
        resolution_note: None,
        resolved_by: None,
        last_query_at: None,
        last_query_result: None,
        created_at: now,
        updated_at: now,
        deadline_at: now + deadline_ms as i64,
        expires_at: now + contract.retention_ms as i64,
        retention_ms: contract.retention_ms as i64,
        terminal_at: None,
        state_since: Some(now),
    };
    op.call_binding_sha256 = binding_of(&op);
    op
}

/// The key the downstream sees, derived from the scope (tenant, subject,
/// tool and the caller's key, all bound by the request) under the ledger's
/// salt: an operation made again for the same scope (a ledger restored from a
/// backup that forgot it, say) reaches the downstream under the same key, so a
/// downstream that de-duplicates catches it even where the ledger cannot; the
/// salt keeps two ledgers with the same tenant and subject names apart. A
/// changed `downstream_key` column is found by recomputing it.
pub(crate) fn downstream_key_of(ledger: &str, [tenant, subject, tool]: [&str; 3], key: &str) -> String {
    let scope = super::retention::scope_sha256(tenant, subject, tool, key);
    let h = sha256_hex(format!("toolgate downstream key v3\0{ledger}\0{scope}").as_bytes());
    format!("dk3_{}", &h[..32])
}

/// The key of rows written between migrations 0009 and 0015, derived from the
/// operation id and its `status_ref` (a new operation of the same scope got a
/// new key).
fn operation_downstream_key(operation_id: &str, status_ref: &str) -> String {
    let h = sha256_hex(format!("toolgate downstream key\0{operation_id}\0{status_ref}").as_bytes());
    format!("dk2_{}", &h[..32])
}

/// Whether a receipt a lookup found is evidence for this operation: bound to
/// its request by what it carries (the request digest the provider recorded,
/// the key it echoes, the arguments the result echoes), and contradicted by
/// none of them. The lookup asked by the operation's downstream key, but a
/// provider (or a path that ignores the key) may answer with another
/// request's receipt, and taking it would bind one receipt to two operations.
/// `Err` says why it is not evidence.
pub(crate) fn receipt_binds(contract: &Contract, op: &OperationRow, r: &Receipt) -> Result<(), &'static str> {
    if r.body_sha256.as_ref().is_some_and(|b| *b != op.request_sha256) {
        return Err("the receipt records another request's digest");
    }
    // The lab's per-attempt keys (`{key}-a{n}`) are the operation's too.
    let ours = |k: &str| {
        k == op.downstream_key
            || k.strip_prefix(op.downstream_key.as_str())
                .and_then(|rest| rest.strip_prefix("-a"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    if r.key.as_deref().is_some_and(|k| !ours(k)) {
        return Err("the receipt was made under another key");
    }
    let args = args_of(&op.request_json);
    if !contract.echoes(&args, &r.result) {
        return Err("the receipt's result echoes other arguments");
    }
    let echoed = contract.result_echoes.iter().any(|k| args.get(k).is_some());
    if r.body_sha256.is_none() && r.key.is_none() && !echoed {
        return Err("nothing in the receipt binds it to this request (no digest, key or echoed argument)");
    }
    Ok(())
}

/// How long an approval request stays open.
pub const APPROVAL_TTL_MS: i64 = 15 * 60 * 1000;

/// The digest an approval binds, before the approver is known.
#[allow(clippy::too_many_arguments)]
pub(crate) fn approval_base_sha256(
    tenant: &str,
    subject: &str,
    tool: &str,
    request_sha256: &str,
    key_sha256: &str,
    call: &CallIdentity,
    rev: Revisions,
    policy_revision: i64,
) -> String {
    digest_value(&json!({
        "tenant": tenant, "subject": subject, "tool": tool, "request_sha256": request_sha256,
        "key_sha256": key_sha256, "call": call, "revisions": rev, "policy_revision": policy_revision,
    }))
}

/// The amount an approver is shown: from the bound, digest-checked request,
/// never from the copy stored beside it.
pub fn approval_amount(a: &ApprovalRow) -> Option<i64> {
    verify_approval(a).ok()?;
    let v: Value = serde_json::from_str(&a.request_json).ok()?;
    v.get("arguments")?.get("amount_minor")?.as_i64()
}

/// Checks an approval row against what binds it: the request digest, every
/// column that restates the request, the key digest, the stored amount copy
/// and the approval's base digest.
pub(crate) fn verify_approval(a: &ApprovalRow) -> Result<(), &'static str> {
    let Ok(request) = super::canonical::parse_strict(a.request_json.as_bytes(), usize::MAX, 256) else {
        return Err("request_json does not parse");
    };
    if super::canonical::canonical_string(&request) != a.request_json {
        return Err("request_json is not canonical");
    }
    if sha256_hex(a.request_json.as_bytes()) != a.request_sha256 {
        return Err("request_sha256 does not recompute");
    }
    check_restated(
        &request,
        [&a.tenant, &a.subject, &a.tool],
        [a.input_rev, a.output_rev, a.effect_rev],
        &a.idem_key,
        &a.key_sha256,
    )?;
    let amount = request.get("arguments").and_then(|x| x.get("amount_minor")).and_then(Value::as_i64);
    if amount != a.amount_minor {
        return Err("amount_minor does not match the bound request");
    }
    let call = approval_call(a);
    let rev = Revisions { input: a.input_rev, output: a.output_rev, effect: a.effect_rev };
    let base = approval_base_sha256(
        &a.tenant,
        &a.subject,
        &a.tool,
        &a.request_sha256,
        &a.key_sha256,
        &call,
        rev,
        a.policy_revision,
    );
    if base != a.base_sha256 {
        return Err("base_sha256 does not recompute");
    }
    Ok(())
}

/// Authorization of the current subject, read now (docs/design.md §1, §5): the
/// grant, then whether the tool's domain lets the subject see the resource the
/// call touches (not owned, another tenant's and missing all answer `NOT_FOUND`).
pub(crate) fn authorize(
    tx: &Tx<'_>,
    domain: &dyn ToolDomain,
    tenant: &str,
    subject: &str,
    tool: &str,
    args: &Value,
) -> Result<Option<Code>, StoreError> {
    // One read: an active grant is joined to the subject's row under the
    // same tenant, so it also proves the subject belongs to this tenant; a
    // disabled subject or tenant is refused whatever its grants.
    match tx.access(tenant, subject, tool)? {
        Access::Granted => {}
        Access::NotGranted => return Ok(Some(Code::PolicyDenied)),
        Access::Disabled => return Ok(Some(Code::SubjectDisabled)),
    }
    if !domain.visible(&tx.domain(), &ToolCall { tenant, subject, tool, arguments: args, operation_id: None })? {
        return Ok(Some(Code::NotFound));
    }
    Ok(None)
}

/// The tool domain's business rules for a new execution (docs/design.md §1);
/// `operation_id` is the accepted operation re-checked by its worker (its own
/// hold does not count against it), `None` at admission.
pub(crate) fn business_rules(
    tx: &Tx<'_>,
    domain: &dyn ToolDomain,
    [tenant, subject, tool]: [&str; 3],
    args: &Value,
    operation_id: Option<&str>,
) -> Result<Option<&'static str>, StoreError> {
    domain.rules(&tx.domain(), &ToolCall { tenant, subject, tool, arguments: args, operation_id })
}

/// The call of a stored operation as its tool's domain sees it (`args`: its
/// arguments, from [`args_of`]).
pub(crate) fn domain_call<'a>(op: &'a OperationRow, args: &'a Value) -> ToolCall<'a> {
    ToolCall { tenant: &op.tenant, subject: &op.subject, tool: &op.tool, arguments: args, operation_id: Some(&op.id) }
}

/// Writes the hold a new execution of an accepted operation reserves (the
/// domain's, [`crate::engine::tool::Hold`]), in the accept's transaction.
pub(crate) fn reserve(
    tx: &Tx<'_>,
    domain: &dyn ToolDomain,
    op: &OperationRow,
    args: &Value,
    now: i64,
) -> Result<(), StoreError> {
    match domain.hold(&domain_call(op, args)) {
        Some(h) => tx.insert_hold(&op.id, &h.resource, h.amount, now),
        None => Ok(()),
    }
}

/// The local state change that goes with a committed effect (the domain's),
/// in the transaction that records the result; `Some` is an anomaly for the
/// step's trace event (see [`ToolDomain::apply`]).
pub(crate) fn apply_business_effect(
    tx: &Tx<'_>,
    domain: &dyn ToolDomain,
    op: &OperationRow,
) -> Result<Option<String>, StoreError> {
    let args = args_of(&op.request_json);
    let result = op.result_json.as_deref().and_then(|r| serde_json::from_str(r).ok()).unwrap_or(Value::Null);
    domain.apply(&tx.domain(), &domain_call(op, &args), &result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> OperationRow {
        OperationRow {
            id: "op_1".into(),
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            tool: "create_refund".into(),
            idem_key: "key-0001".into(),
            key_sha256: "k".into(),
            request_sha256: "r".into(),
            request_json: "{}".into(),
            input_rev: 1,
            output_rev: 1,
            effect_rev: 1,
            effect: "write".into(),
            state: OpState::Succeeded,
            version: 3,
            status_ref: "sr".into(),
            downstream_key: "dk".into(),
            code: None,
            result_json: Some("{}".into()),
            result_sha256: Some("h".into()),
            downstream_request_id: Some("dreq".into()),
            receipt_id: Some("rcpt".into()),
            call_binding_sha256: "b".into(),
            call_provider: "openai".into(),
            call_api_family: "responses".into(),
            call_response_id: "resp".into(),
            call_id: "call".into(),
            adapter_revision: "1".into(),
            approval_id: None,
            resolution: None,
            resolution_note: None,
            resolved_by: None,
            last_query_at: None,
            last_query_result: None,
            created_at: 1,
            updated_at: 2,
            deadline_at: 3,
            expires_at: 4,
            retention_ms: 5,
            terminal_at: Some(2),
            state_since: Some(2),
        }
    }

    /// The memo of verified rows is keyed on this digest: a change to any
    /// column the checks read must miss it, and a change to a column they do
    /// not read (the row's life: version, times, code) must not.
    #[test]
    fn the_verified_digest_covers_every_checked_column_and_only_those() {
        type Edit = fn(&mut OperationRow);
        let checked: Vec<(&str, Edit)> = vec![
            ("id", |o| o.id.push('x')),
            ("state", |o| o.state = OpState::Failed),
            ("tenant", |o| o.tenant.push('x')),
            ("subject", |o| o.subject.push('x')),
            ("tool", |o| o.tool.push('x')),
            ("idem_key", |o| o.idem_key.push('x')),
            ("key_sha256", |o| o.key_sha256.push('x')),
            ("request_sha256", |o| o.request_sha256.push('x')),
            ("request_json", |o| o.request_json.push(' ')),
            ("input_rev", |o| o.input_rev += 1),
            ("output_rev", |o| o.output_rev += 1),
            ("effect_rev", |o| o.effect_rev += 1),
            ("status_ref", |o| o.status_ref.push('x')),
            ("downstream_key", |o| o.downstream_key.push('x')),
            ("result_json", |o| o.result_json = None),
            ("result_json moved", |o| o.result_json = Some("{} ".into())),
            ("result_sha256", |o| o.result_sha256 = Some(String::new())),
            ("downstream_request_id", |o| o.downstream_request_id = None),
            ("receipt_id", |o| o.receipt_id = Some("rcpt2".into())),
            ("call_binding_sha256", |o| o.call_binding_sha256.push('x')),
            ("call_provider", |o| o.call_provider.push('x')),
            ("call_api_family", |o| o.call_api_family.push('x')),
            ("call_response_id", |o| o.call_response_id.push('x')),
            ("call_id", |o| o.call_id.push('x')),
            ("adapter_revision", |o| o.adapter_revision.push('x')),
            // Text moved from one column to its neighbour: the lengths tell.
            ("tenant|subject boundary", |o| {
                o.tenant.push('a');
                o.subject.remove(0);
            }),
        ];
        let base = Checked::of(&row()).digest();
        for (what, edit) in checked {
            let mut o = row();
            edit(&mut o);
            assert_ne!(Checked::of(&o).digest(), base, "{what}: a checked column changed but the digest did not");
        }
        let unchecked: Vec<(&str, Edit)> = vec![
            ("version", |o| o.version += 1),
            ("code", |o| o.code = Some("X".into())),
            ("updated_at", |o| o.updated_at += 1),
            ("deadline_at", |o| o.deadline_at += 1),
            ("approval_id", |o| o.approval_id = Some("ap".into())),
            ("last_query_at", |o| o.last_query_at = Some(9)),
            ("terminal_at", |o| o.terminal_at = None),
        ];
        for (what, edit) in unchecked {
            let mut o = row();
            edit(&mut o);
            assert_eq!(Checked::of(&o).digest(), base, "{what}: not a checked column, yet the digest moved");
        }
    }
}
