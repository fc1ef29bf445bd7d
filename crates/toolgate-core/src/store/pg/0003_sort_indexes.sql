-- PostgreSQL 0003: the sort indexes of SQLite migration 0011 (see there).
CREATE INDEX operations_since ON operations (coalesce(state_since, updated_at), id);
CREATE INDEX operations_created ON operations (created_at, id);
CREATE INDEX operations_tool ON operations (tool, id);
CREATE INDEX operations_tenant ON operations (tenant, id);
CREATE INDEX operations_state_id ON operations (state, id);
CREATE INDEX operations_code ON operations (coalesce(code, ''), id);
CREATE INDEX unknown_updated ON operations (updated_at, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_operation ON operations (id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_since ON operations (coalesce(state_since, updated_at), id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_created ON operations (created_at, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_tool ON operations (tool, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_scope ON operations (tenant, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_state ON operations (state, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_code ON operations (coalesce(code, ''), id) WHERE state IN ('unknown', 'needs_review');
