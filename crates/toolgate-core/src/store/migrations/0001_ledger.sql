-- 0001: the world, the idempotency ledger, the outbox, attempts, call identities,
-- receipts, trace events, and the simulated downstream providers' own tables.
-- Times are integer milliseconds since the Unix epoch (UTC).

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) STRICT;

CREATE TABLE tenants (
    id                       TEXT PRIMARY KEY,
    approval_threshold_minor INTEGER NOT NULL CHECK (approval_threshold_minor >= 0),
    policy_revision          INTEGER NOT NULL DEFAULT 1
) STRICT;

CREATE TABLE approvers (
    tenant   TEXT NOT NULL REFERENCES tenants(id),
    approver TEXT NOT NULL,
    PRIMARY KEY (tenant, approver)
) STRICT;

CREATE TABLE subjects (
    id     TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(id)
) STRICT;

CREATE TABLE grants (
    tenant     TEXT NOT NULL REFERENCES tenants(id),
    subject    TEXT NOT NULL REFERENCES subjects(id),
    tool       TEXT NOT NULL,
    granted_at INTEGER NOT NULL,
    revoked_at INTEGER,
    PRIMARY KEY (tenant, subject, tool)
) STRICT;

CREATE TABLE orders (
    order_ref      TEXT PRIMARY KEY,
    tenant         TEXT NOT NULL REFERENCES tenants(id),
    owner          TEXT NOT NULL REFERENCES subjects(id),
    currency       TEXT NOT NULL,
    captured_minor INTEGER NOT NULL CHECK (captured_minor >= 0),
    refunded_minor INTEGER NOT NULL CHECK (refunded_minor >= 0 AND refunded_minor <= captured_minor),
    status         TEXT NOT NULL CHECK (status IN ('paid', 'partially_refunded', 'refunded')),
    revision       INTEGER NOT NULL DEFAULT 1
) STRICT;

-- The idempotency ledger: one row per business intent (scope).
CREATE TABLE operations (
    id                    TEXT PRIMARY KEY,
    tenant                TEXT NOT NULL,
    subject               TEXT NOT NULL,
    tool                  TEXT NOT NULL,
    idem_key              TEXT NOT NULL,
    key_sha256            TEXT NOT NULL,
    request_sha256        TEXT NOT NULL,
    request_json          TEXT NOT NULL,
    input_rev             INTEGER NOT NULL,
    output_rev            INTEGER NOT NULL,
    effect_rev            INTEGER NOT NULL,
    effect                TEXT NOT NULL CHECK (effect IN ('write', 'external')),
    state                 TEXT NOT NULL CHECK (state IN
                              ('accepted', 'in_flight', 'succeeded', 'failed',
                               'unknown', 'needs_review', 'resolved')),
    version               INTEGER NOT NULL DEFAULT 1,
    status_ref            TEXT NOT NULL UNIQUE,
    downstream_key        TEXT NOT NULL,
    code                  TEXT,
    result_json           TEXT,
    result_sha256         TEXT,
    downstream_request_id TEXT,
    receipt_id            TEXT,
    call_binding_sha256   TEXT NOT NULL,
    -- the call identity that created the operation (bound into call_binding_sha256)
    call_provider         TEXT NOT NULL,
    call_api_family       TEXT NOT NULL,
    call_response_id      TEXT NOT NULL,
    call_id               TEXT NOT NULL,
    adapter_revision      TEXT NOT NULL,
    approval_id           TEXT,
    resolution            TEXT CHECK (resolution IS NULL OR resolution IN ('succeeded', 'failed', 'compensated')),
    resolution_note       TEXT,
    resolved_by           TEXT,
    last_query_at         INTEGER,
    last_query_result     TEXT,
    created_at            INTEGER NOT NULL,
    updated_at            INTEGER NOT NULL,
    deadline_at           INTEGER NOT NULL,
    expires_at            INTEGER NOT NULL,
    UNIQUE (tenant, subject, tool, idem_key)
) STRICT;
CREATE INDEX operations_state ON operations (state, updated_at, id);
CREATE INDEX operations_updated ON operations (updated_at, id);

-- The transactional outbox: one delivery row per accepted operation.
CREATE TABLE outbox (
    operation_id TEXT PRIMARY KEY REFERENCES operations(id),
    state        TEXT NOT NULL CHECK (state IN ('pending', 'leased', 'done', 'parked')),
    attempt      INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    lease_owner  TEXT,
    lease_until  INTEGER,
    available_at INTEGER NOT NULL,
    last_code    TEXT,
    CHECK ((state = 'leased') = (lease_owner IS NOT NULL AND lease_until IS NOT NULL))
) STRICT;
CREATE INDEX outbox_ready ON outbox (state, available_at);

-- One row per delivery attempt: the evidence of what was (provably not) sent.
CREATE TABLE attempts (
    operation_id TEXT NOT NULL REFERENCES operations(id),
    attempt      INTEGER NOT NULL,
    owner        TEXT NOT NULL,
    claimed_at   INTEGER NOT NULL,
    sent_at      INTEGER,
    finished_at  INTEGER,
    -- not_sent: never left; refused: provably not received downstream;
    -- committed / rejected: downstream answered; unknown: may have been received.
    outcome      TEXT CHECK (outcome IS NULL OR outcome IN ('not_sent', 'refused', 'committed', 'rejected', 'unknown')),
    code         TEXT,
    PRIMARY KEY (operation_id, attempt)
) STRICT;

-- A call identity is bound on first use to one request, one key and one purpose.
CREATE TABLE call_identities (
    tenant         TEXT NOT NULL,
    subject        TEXT NOT NULL,
    provider       TEXT NOT NULL,
    api_family     TEXT NOT NULL,
    response_id    TEXT NOT NULL,
    call_id        TEXT NOT NULL,
    purpose        TEXT NOT NULL CHECK (purpose IN ('dispatch', 'query_status')),
    request_sha256 TEXT NOT NULL,
    key_sha256     TEXT NOT NULL,
    operation_id   TEXT,
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (tenant, subject, provider, api_family, response_id, call_id)
) STRICT;

-- Downstream receipts the ledger has seen (from a reply or a status query).
CREATE TABLE receipts (
    receipt_id     TEXT PRIMARY KEY,
    operation_id   TEXT NOT NULL,
    request_id     TEXT NOT NULL,
    body_sha256    TEXT NOT NULL,
    result_sha256  TEXT NOT NULL,
    source         TEXT NOT NULL CHECK (source IN ('reply', 'query')),
    recorded_at    INTEGER NOT NULL
) STRICT;

-- One event per pipeline step. Never raw arguments: only digests.
CREATE TABLE trace_events (
    seq          INTEGER PRIMARY KEY,
    at           INTEGER NOT NULL,
    operation_id TEXT,
    step         TEXT NOT NULL,
    tool         TEXT,
    code         TEXT,
    outcome      TEXT,
    delivery     TEXT,
    attempt      INTEGER,
    duration_us  INTEGER,
    fields       TEXT NOT NULL
) STRICT;
CREATE INDEX trace_by_operation ON trace_events (operation_id, seq);

-- The simulated downstream providers' own durable tables. The engine never reads
-- them: only the `downstream` adapters do, through `store::provider`.
CREATE TABLE provider_effects (
    seq            INTEGER PRIMARY KEY,
    provider       TEXT NOT NULL,
    downstream_key TEXT NOT NULL,
    intent         TEXT NOT NULL,
    body_sha256    TEXT NOT NULL,
    request_id     TEXT NOT NULL,
    receipt_id     TEXT NOT NULL UNIQUE,
    result_json    TEXT NOT NULL,
    committed_at   INTEGER NOT NULL,
    visible_at     INTEGER NOT NULL
) STRICT;
CREATE INDEX provider_effects_key ON provider_effects (provider, downstream_key);
CREATE INDEX provider_effects_intent ON provider_effects (intent);

-- Pending approval requests: each holds the exact call it would run.
CREATE TABLE approvals (
    id                TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    subject           TEXT NOT NULL,
    tool              TEXT NOT NULL,
    idem_key          TEXT NOT NULL,
    key_sha256        TEXT NOT NULL,
    request_sha256    TEXT NOT NULL,
    request_json      TEXT NOT NULL,
    input_rev         INTEGER NOT NULL,
    output_rev        INTEGER NOT NULL,
    effect_rev        INTEGER NOT NULL,
    policy_revision   INTEGER NOT NULL,
    call_provider     TEXT NOT NULL,
    call_api_family   TEXT NOT NULL,
    call_response_id  TEXT NOT NULL,
    call_id           TEXT NOT NULL,
    adapter_revision  TEXT NOT NULL,
    amount_minor      INTEGER,
    base_sha256       TEXT NOT NULL,
    approval_sha256   TEXT,
    state             TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'denied', 'expired', 'invalidated')),
    decided_by        TEXT,
    decided_at        INTEGER,
    note              TEXT,
    operation_id      TEXT,
    deadline_ms       INTEGER NOT NULL,
    created_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL
) STRICT;
CREATE INDEX approvals_scope ON approvals (tenant, subject, tool, idem_key, created_at);
CREATE INDEX approvals_state ON approvals (state, expires_at);

-- The operator log: append-only. No UPDATE or DELETE path exists in the code,
-- and these triggers refuse them from anywhere else.
CREATE TABLE audit_log (
    seq          INTEGER PRIMARY KEY,
    at           INTEGER NOT NULL,
    action_id    TEXT UNIQUE,
    actor        TEXT NOT NULL,
    action       TEXT NOT NULL,
    operation_id TEXT,
    approval_id  TEXT,
    result       TEXT NOT NULL CHECK (result IN ('applied', 'refused')),
    reason       TEXT NOT NULL,
    evidence     TEXT NOT NULL
) STRICT;
CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END;
CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END;
