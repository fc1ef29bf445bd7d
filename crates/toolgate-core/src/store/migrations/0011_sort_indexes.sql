-- 0011: every order the console sorts the Ledger and Unknown panes by is
-- index-backed (issue 19 §2), so the first page of any sort reads one page of
-- index entries, not the whole ledger. Each index matches the keyset ORDER BY
-- of `OPS_SORT` in store/views.rs: the sort expression (written exactly as
-- there, for the expression ones) and the `id` tie-breaker; one index serves
-- both directions. `updated` (operations_updated) and `operation` (the primary
-- key) were backed already.
CREATE INDEX operations_since ON operations (coalesce(state_since, updated_at), id);
CREATE INDEX operations_created ON operations (created_at, id);
CREATE INDEX operations_tool ON operations (tool, id);
CREATE INDEX operations_tenant ON operations (tenant, id);
CREATE INDEX operations_state_id ON operations (state, id);
CREATE INDEX operations_code ON operations (coalesce(code, ''), id);
-- The Unknown pane filters on state first. Partial indexes hold only its rows
-- (small, and written only when an operation enters or leaves those states),
-- in each of its orders; their WHERE is the pane's condition, word for word.
-- Each is named `unknown_` + the column's name in OPS_SORT: without statistics
-- SQLite guesses that `state IN (…)` picks out a few rows and would seek them on
-- operations_state and sort them all (every unknown operation, each frame), so
-- the pane's query names its index (`INDEXED BY`, which fails loudly if the
-- index is missing rather than going slow).
CREATE INDEX unknown_updated ON operations (updated_at, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_operation ON operations (id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_since ON operations (coalesce(state_since, updated_at), id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_created ON operations (created_at, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_tool ON operations (tool, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_scope ON operations (tenant, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_state ON operations (state, id) WHERE state IN ('unknown', 'needs_review');
CREATE INDEX unknown_code ON operations (coalesce(code, ''), id) WHERE state IN ('unknown', 'needs_review');
