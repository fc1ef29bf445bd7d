-- PostgreSQL 0008: the operator log's head anchored on the rows its entries
-- touch (SQLite 0017; see there).
ALTER TABLE operations ADD COLUMN audit_anchor TEXT;
ALTER TABLE approvals ADD COLUMN audit_anchor TEXT;
