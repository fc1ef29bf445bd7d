-- PostgreSQL 0001: the ledger at the shape of SQLite schema 9 (src/store/migrations/
-- 0001-0009), in PostgreSQL's words, without the simulated providers' tables
-- (theirs: src/store/provider/). Times are integer milliseconds since the Unix
-- epoch (UTC), every integer is BIGINT, and the triggers that SQLite's migrations
-- define (append-only operator log, counters, metric rollups) are plpgsql here,
-- running in the writer's transaction exactly as there.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE tenants (
    id                       TEXT PRIMARY KEY,
    approval_threshold_minor BIGINT NOT NULL CHECK (approval_threshold_minor >= 0),
    policy_revision          BIGINT NOT NULL DEFAULT 1
);

CREATE TABLE approvers (
    tenant   TEXT NOT NULL REFERENCES tenants(id),
    approver TEXT NOT NULL,
    PRIMARY KEY (tenant, approver)
);

CREATE TABLE subjects (
    id     TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(id)
);

CREATE TABLE grants (
    tenant     TEXT NOT NULL REFERENCES tenants(id),
    subject    TEXT NOT NULL REFERENCES subjects(id),
    tool       TEXT NOT NULL,
    granted_at BIGINT NOT NULL,
    revoked_at BIGINT,
    PRIMARY KEY (tenant, subject, tool)
);

CREATE TABLE orders (
    order_ref      TEXT PRIMARY KEY,
    tenant         TEXT NOT NULL REFERENCES tenants(id),
    owner          TEXT NOT NULL REFERENCES subjects(id),
    currency       TEXT NOT NULL,
    captured_minor BIGINT NOT NULL CHECK (captured_minor >= 0),
    refunded_minor BIGINT NOT NULL CHECK (refunded_minor >= 0 AND refunded_minor <= captured_minor),
    status         TEXT NOT NULL CHECK (status IN ('paid', 'partially_refunded', 'refunded')),
    revision       BIGINT NOT NULL DEFAULT 1
);

CREATE TABLE operations (
    -- insertion order (SQLite's rowid; the same queries name it)
    rowid                 BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id                    TEXT PRIMARY KEY,
    tenant                TEXT NOT NULL,
    subject               TEXT NOT NULL,
    tool                  TEXT NOT NULL,
    idem_key              TEXT NOT NULL,
    key_sha256            TEXT NOT NULL,
    request_sha256        TEXT NOT NULL,
    request_json          TEXT NOT NULL,
    input_rev             BIGINT NOT NULL,
    output_rev            BIGINT NOT NULL,
    effect_rev            BIGINT NOT NULL,
    effect                TEXT NOT NULL CHECK (effect IN ('write', 'external')),
    state                 TEXT NOT NULL CHECK (state IN
                              ('accepted', 'in_flight', 'succeeded', 'failed',
                               'unknown', 'needs_review', 'resolved')),
    version               BIGINT NOT NULL DEFAULT 1,
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
    last_query_at         BIGINT,
    last_query_result     TEXT,
    created_at            BIGINT NOT NULL,
    updated_at            BIGINT NOT NULL,
    deadline_at           BIGINT NOT NULL,
    expires_at            BIGINT NOT NULL, retention_ms BIGINT NOT NULL DEFAULT 0 CHECK (retention_ms >= 0), terminal_at BIGINT, state_since BIGINT,
    UNIQUE (tenant, subject, tool, idem_key)
);

CREATE INDEX operations_state ON operations (state, updated_at, id);

CREATE INDEX operations_updated ON operations (updated_at, id);

CREATE TABLE outbox (
    operation_id TEXT PRIMARY KEY REFERENCES operations(id),
    state        TEXT NOT NULL CHECK (state IN ('pending', 'leased', 'done', 'parked')),
    attempt      BIGINT NOT NULL DEFAULT 0,
    max_attempts BIGINT NOT NULL,
    lease_owner  TEXT,
    lease_until  BIGINT,
    available_at BIGINT NOT NULL,
    last_code    TEXT,
    CHECK ((state = 'leased') = (lease_owner IS NOT NULL AND lease_until IS NOT NULL))
);

CREATE INDEX outbox_ready ON outbox (state, available_at);

CREATE TABLE attempts (
    operation_id TEXT NOT NULL REFERENCES operations(id),
    attempt      BIGINT NOT NULL,
    owner        TEXT NOT NULL,
    claimed_at   BIGINT NOT NULL,
    sent_at      BIGINT,
    finished_at  BIGINT,
    -- not_sent: never left; refused: provably not received downstream;

-- committed / rejected: downstream answered; unknown: may have been received.
    outcome      TEXT CHECK (outcome IS NULL OR outcome IN ('not_sent', 'refused', 'committed', 'rejected', 'unknown')),
    code         TEXT,
    PRIMARY KEY (operation_id, attempt)
);

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
    created_at     BIGINT NOT NULL,
    PRIMARY KEY (tenant, subject, provider, api_family, response_id, call_id)
);

CREATE TABLE receipts (
    receipt_id     TEXT PRIMARY KEY,
    operation_id   TEXT NOT NULL,
    request_id     TEXT NOT NULL,
    body_sha256    TEXT NOT NULL,
    result_sha256  TEXT NOT NULL,
    source         TEXT NOT NULL CHECK (source IN ('reply', 'query')),
    recorded_at    BIGINT NOT NULL
);

CREATE TABLE trace_events (
    seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    at           BIGINT NOT NULL,
    operation_id TEXT,
    step         TEXT NOT NULL,
    tool         TEXT,
    code         TEXT,
    outcome      TEXT,
    delivery     TEXT,
    attempt      BIGINT,
    duration_us  BIGINT,
    fields       TEXT NOT NULL
, answer TEXT, latency_us BIGINT, tenant_ref TEXT, tool_version TEXT, timeout_stage TEXT, reason TEXT, latency_bucket_us BIGINT);

CREATE INDEX trace_by_operation ON trace_events (operation_id, seq);

CREATE TABLE approvals (
    rowid             BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id                TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    subject           TEXT NOT NULL,
    tool              TEXT NOT NULL,
    idem_key          TEXT NOT NULL,
    key_sha256        TEXT NOT NULL,
    request_sha256    TEXT NOT NULL,
    request_json      TEXT NOT NULL,
    input_rev         BIGINT NOT NULL,
    output_rev        BIGINT NOT NULL,
    effect_rev        BIGINT NOT NULL,
    policy_revision   BIGINT NOT NULL,
    call_provider     TEXT NOT NULL,
    call_api_family   TEXT NOT NULL,
    call_response_id  TEXT NOT NULL,
    call_id           TEXT NOT NULL,
    adapter_revision  TEXT NOT NULL,
    amount_minor      BIGINT,
    base_sha256       TEXT NOT NULL,
    approval_sha256   TEXT,
    state             TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'denied', 'expired', 'invalidated')),
    decided_by        TEXT,
    decided_at        BIGINT,
    note              TEXT,
    operation_id      TEXT,
    deadline_ms       BIGINT NOT NULL,
    created_at        BIGINT NOT NULL,
    expires_at        BIGINT NOT NULL
);

CREATE INDEX approvals_scope ON approvals (tenant, subject, tool, idem_key, created_at);

CREATE INDEX approvals_state ON approvals (state, expires_at);

CREATE TABLE audit_log (
    seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    at           BIGINT NOT NULL,
    action_id    TEXT UNIQUE,
    actor        TEXT NOT NULL,
    action       TEXT NOT NULL,
    operation_id TEXT,
    approval_id  TEXT,
    result       TEXT NOT NULL CHECK (result IN ('applied', 'refused')),
    reason       TEXT NOT NULL,
    evidence     TEXT NOT NULL
, chain_sha256 TEXT);

CREATE INDEX trace_at ON trace_events (at, seq);

CREATE TABLE metric_totals (
    answer         TEXT NOT NULL,
    step           TEXT NOT NULL,
    tool           TEXT NOT NULL,
    tenant_ref     TEXT NOT NULL,
    tool_version   TEXT NOT NULL,
    code           TEXT NOT NULL,
    outcome        TEXT NOT NULL,
    delivery       TEXT NOT NULL,
    timeout_stage  TEXT NOT NULL,
    reason         TEXT NOT NULL,
    events         BIGINT NOT NULL,
    latency_sum_us BIGINT NOT NULL,
    PRIMARY KEY (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
);

CREATE TABLE metric_minutes (
    minute         BIGINT NOT NULL,
    answer         TEXT NOT NULL,
    step           TEXT NOT NULL,
    tool           TEXT NOT NULL,
    tenant_ref     TEXT NOT NULL,
    tool_version   TEXT NOT NULL,
    code           TEXT NOT NULL,
    outcome        TEXT NOT NULL,
    delivery       TEXT NOT NULL,
    timeout_stage  TEXT NOT NULL,
    reason         TEXT NOT NULL,
    events         BIGINT NOT NULL,
    latency_sum_us BIGINT NOT NULL,
    PRIMARY KEY (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
);

CREATE TABLE latency_totals (
    answer       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    tenant_ref   TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    bucket_us    BIGINT NOT NULL,
    count        BIGINT NOT NULL,
    PRIMARY KEY (answer, tool, tenant_ref, tool_version, bucket_us)
);

CREATE TABLE latency_minutes (
    minute       BIGINT NOT NULL,
    answer       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    tenant_ref   TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    bucket_us    BIGINT NOT NULL,
    count        BIGINT NOT NULL,
    PRIMARY KEY (minute, answer, tool, tenant_ref, tool_version, bucket_us)
);

CREATE TABLE state_counts (
    state TEXT PRIMARY KEY,
    n     BIGINT NOT NULL
);

CREATE TABLE retry_budgets (
    tool           TEXT PRIMARY KEY,
    tokens_milli   BIGINT NOT NULL CHECK (tokens_milli >= 0),
    capacity_milli BIGINT NOT NULL CHECK (capacity_milli >= 0),
    -- retries the budget allowed / refused, for all time (metrics)
    retries        BIGINT NOT NULL DEFAULT 0 CHECK (retries >= 0),
    refused        BIGINT NOT NULL DEFAULT 0 CHECK (refused >= 0),
    updated_at     BIGINT NOT NULL
);

CREATE TABLE circuits (
    downstream           TEXT PRIMARY KEY,
    state                TEXT NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    consecutive_failures BIGINT NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    -- open: no call before this instant
    open_until           BIGINT,
    -- half_open: the operation sending the probe, and until when its slot is held
    probe_operation      TEXT,
    probe_until          BIGINT,
    -- for all time (metrics)
    opened_total         BIGINT NOT NULL DEFAULT 0 CHECK (opened_total >= 0),
    refused_total        BIGINT NOT NULL DEFAULT 0 CHECK (refused_total >= 0),
    updated_at           BIGINT NOT NULL,
    CHECK ((state = 'open') = (open_until IS NOT NULL)),
    CHECK ((state = 'half_open') = (probe_until IS NOT NULL))
);

CREATE INDEX operations_purge ON operations (expires_at) WHERE terminal_at IS NOT NULL;

CREATE TABLE purged_operations (
    operation_id   TEXT PRIMARY KEY,
    -- SHA-256 of the canonical {tenant, subject, tool, idempotency_key}
    scope_sha256   TEXT NOT NULL,
    tool           TEXT NOT NULL,
    final_state    TEXT NOT NULL CHECK (final_state IN ('succeeded', 'failed', 'resolved')),
    code           TEXT,
    request_sha256 TEXT NOT NULL,
    result_sha256  TEXT,
    receipt_id     TEXT,
    created_at     BIGINT NOT NULL,
    terminal_at    BIGINT NOT NULL,
    purged_at      BIGINT NOT NULL,
    reason         TEXT NOT NULL
);

CREATE INDEX purged_operations_scope ON purged_operations (scope_sha256);

CREATE INDEX operations_key ON operations (idem_key, tenant, subject);

-- ------------------------------------------------------------------ triggers

-- The operator log is append-only: no UPDATE or DELETE path exists in the code,
-- and this trigger refuses them from anywhere else (TRUNCATE too).
CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only';
END $$;
CREATE TRIGGER audit_log_no_update BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only();

-- Counts per state, kept in the writer's transaction (SQLite migration 0003).
CREATE FUNCTION state_counts_keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE state_counts SET n = n - 1 WHERE state = OLD.state;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO state_counts (state, n) VALUES (NEW.state, 1)
        ON CONFLICT (state) DO UPDATE SET n = state_counts.n + 1;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER state_counts_insert AFTER INSERT OR DELETE ON operations
    FOR EACH ROW EXECUTE FUNCTION state_counts_keep();
CREATE TRIGGER state_counts_update AFTER UPDATE OF state ON operations
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION state_counts_keep();

-- The metric rollups commit or roll back with the trace event itself
-- (SQLite migrations 0002 and 0006).
CREATE FUNCTION trace_events_rollup() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO metric_totals VALUES (
        coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
        coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
        coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
        1, coalesce(NEW.latency_us, 0))
    ON CONFLICT (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
    DO UPDATE SET events = metric_totals.events + 1,
                  latency_sum_us = metric_totals.latency_sum_us + excluded.latency_sum_us;

    INSERT INTO metric_minutes VALUES (
        NEW.at / 60000, coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
        coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
        coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
        1, coalesce(NEW.latency_us, 0))
    ON CONFLICT (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
    DO UPDATE SET events = metric_minutes.events + 1,
                  latency_sum_us = metric_minutes.latency_sum_us + excluded.latency_sum_us;

    IF NEW.answer IS NOT NULL AND NEW.latency_bucket_us IS NOT NULL THEN
        INSERT INTO latency_totals VALUES (
            NEW.answer, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
            coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, 1)
        ON CONFLICT (answer, tool, tenant_ref, tool_version, bucket_us)
        DO UPDATE SET count = latency_totals.count + 1;

        INSERT INTO latency_minutes VALUES (
            NEW.at / 60000, NEW.answer, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
            coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, 1)
        ON CONFLICT (minute, answer, tool, tenant_ref, tool_version, bucket_us)
        DO UPDATE SET count = latency_minutes.count + 1;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER trace_events_rollup AFTER INSERT ON trace_events
    FOR EACH ROW EXECUTE FUNCTION trace_events_rollup();

-- ----------------------------------------------------------------- functions

-- SQLite's json_valid, for the audit's check of trace fields (the same query
-- runs on both backends).
CREATE FUNCTION json_valid(t TEXT) RETURNS BIGINT LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    PERFORM t::json;
    RETURN 1;
EXCEPTION WHEN others THEN
    RETURN 0;
END $$;
