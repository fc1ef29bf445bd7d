-- 0005: retention counts from the moment an operation became terminal, an
-- operation a person acted on is never purged while its audit entries exist
-- (the audit log is append-only, so: never), and a purged operation leaves a
-- tombstone so the audit log and the trace still resolve.

-- How long a terminal operation is kept (the tool's retention when it was accepted).
ALTER TABLE operations ADD COLUMN retention_ms INTEGER NOT NULL DEFAULT 0 CHECK (retention_ms >= 0);
-- When the operation became terminal (succeeded, failed, resolved); NULL before.
ALTER TABLE operations ADD COLUMN terminal_at INTEGER;

-- Until this migration `expires_at` was creation + retention. From now on it is
-- the earliest purge time: terminal_at + retention_ms once terminal (before
-- that it is not used). Rows written before the migration: the last change of a
-- terminal row is the best record of when it became terminal.
UPDATE operations SET retention_ms = max(expires_at - created_at, 0);
UPDATE operations SET terminal_at = updated_at, expires_at = updated_at + retention_ms
 WHERE state IN ('succeeded', 'failed', 'resolved');

CREATE INDEX operations_purge ON operations (expires_at) WHERE terminal_at IS NOT NULL;

-- What is left of a purged operation: enough to say what it was and why it is
-- gone, nothing of its arguments or result beyond their digests.
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
    created_at     INTEGER NOT NULL,
    terminal_at    INTEGER NOT NULL,
    purged_at      INTEGER NOT NULL,
    reason         TEXT NOT NULL
) STRICT;
CREATE INDEX purged_operations_scope ON purged_operations (scope_sha256);
