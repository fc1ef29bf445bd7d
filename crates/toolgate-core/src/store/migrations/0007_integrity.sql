-- 0007: integrity that `toolgate audit` can check.

-- A scope whose tool column was changed by hand is found by its key, so a
-- replay meets the damaged row instead of running a second time.
CREATE INDEX operations_key ON operations (idem_key, tenant, subject);

-- The operator log is a hash chain: each row carries the SHA-256 of the row
-- before it (its content and its own link), and meta `audit_head` the hash of
-- the newest row, so a deleted, changed or inserted row breaks the chain even
-- where the append-only triggers were dropped. Rows written before this
-- migration have no link of their own; the first linked row covers them.
ALTER TABLE audit_log ADD COLUMN chain_sha256 TEXT;
