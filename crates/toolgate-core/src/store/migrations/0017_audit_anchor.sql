-- 0017: the operator log's head is anchored on the rows its entries touch
-- (issue 33 High 3). Each entry about an operation or an approval writes the
-- chain hash it made the head into that row's `audit_anchor`; `audit` finds
-- every anchor in the log. Emptying the log and deleting meta `audit_head`
-- (one DELETE each, triggers disabled) no longer leaves a consistent story:
-- every touched operation still names a head the log no longer holds. NULL on
-- rows written before this migration (their decisions are cross-checked
-- against the log entries instead).
ALTER TABLE operations ADD COLUMN audit_anchor TEXT;
ALTER TABLE approvals ADD COLUMN audit_anchor TEXT;
