-- PostgreSQL 0009: the retention purge chooses and deletes by index (SQLite
-- 0018; see there).
CREATE INDEX audit_log_operation ON audit_log (operation_id) WHERE operation_id IS NOT NULL;
CREATE INDEX receipts_operation ON receipts (operation_id);
CREATE INDEX call_identities_operation ON call_identities (operation_id) WHERE operation_id IS NOT NULL;
