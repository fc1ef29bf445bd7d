-- 0018: the retention purge chooses and deletes by index (issue 40). Each
-- batch asked, per candidate, whether a person acted on it: a correlated
-- subquery over the whole operator log (no index on its operation_id), and
-- each purged operation then deleted its receipts and call-identity bindings
-- by operation_id, two full scans more. At 100k operations one batch held the
-- write lock for ~85 s and dispatches failed behind it.
CREATE INDEX audit_log_operation ON audit_log (operation_id) WHERE operation_id IS NOT NULL;
CREATE INDEX receipts_operation ON receipts (operation_id);
CREATE INDEX call_identities_operation ON call_identities (operation_id) WHERE operation_id IS NOT NULL;
