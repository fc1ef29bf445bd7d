-- PostgreSQL 0002: the bearer tokens of SQLite migration 0010 (see there).
CREATE TABLE api_tokens (
    id            TEXT PRIMARY KEY,
    prefix        TEXT NOT NULL UNIQUE,
    secret_sha256 TEXT NOT NULL,
    kind          TEXT NOT NULL CHECK (kind IN ('subject', 'operator')),
    tenant        TEXT REFERENCES tenants(id),
    subject       TEXT REFERENCES subjects(id),
    operator      TEXT,
    name          TEXT,
    created_at    BIGINT NOT NULL,
    expires_at    BIGINT,
    revoked_at    BIGINT,
    CHECK ((kind = 'subject' AND tenant IS NOT NULL AND subject IS NOT NULL AND operator IS NULL)
        OR (kind = 'operator' AND operator IS NOT NULL AND tenant IS NULL AND subject IS NULL))
);
