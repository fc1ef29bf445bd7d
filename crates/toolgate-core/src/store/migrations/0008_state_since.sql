-- 0008: when an operation entered its current state, so "unknown since" means
-- since it became unknown (a status query that changes nothing does not reset
-- it). Rows written before this migration: their last change.
ALTER TABLE operations ADD COLUMN state_since INTEGER;
UPDATE operations SET state_since = updated_at;
