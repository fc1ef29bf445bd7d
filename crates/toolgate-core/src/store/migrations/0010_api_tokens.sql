-- 0010: bearer tokens for the HTTP API (`toolgate token`, `toolgate serve`).
-- A token is `tgt_<public id>_<secret>`; only the SHA-256 of the secret is kept
-- (never the token), with the public part (`prefix`) to show in lists. A token
-- is either a subject's (tenant + subject) or an operator's (operator), never
-- both. Revocation and expiry are read at every request.
CREATE TABLE api_tokens (
    id            TEXT PRIMARY KEY,
    prefix        TEXT NOT NULL UNIQUE,
    secret_sha256 TEXT NOT NULL,
    kind          TEXT NOT NULL CHECK (kind IN ('subject', 'operator')),
    tenant        TEXT REFERENCES tenants(id),
    subject       TEXT REFERENCES subjects(id),
    operator      TEXT,
    name          TEXT,
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER,
    revoked_at    INTEGER,
    CHECK ((kind = 'subject' AND tenant IS NOT NULL AND subject IS NOT NULL AND operator IS NULL)
        OR (kind = 'operator' AND operator IS NOT NULL AND tenant IS NULL AND subject IS NULL))
) STRICT;
