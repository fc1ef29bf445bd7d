-- 0006 (PostgreSQL): downstream keys derived from the scope, as SQLite's
-- migration 0015 (which says why).
INSERT INTO meta (key, value)
VALUES ('dk2_downstream_keys_until_rowid', (SELECT coalesce(max(rowid), 0) FROM operations)::text)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
