-- PostgreSQL 0007: operator tokens scoped to tenants (SQLite 0016; see there).
ALTER TABLE api_tokens ADD COLUMN operator_tenants TEXT;
