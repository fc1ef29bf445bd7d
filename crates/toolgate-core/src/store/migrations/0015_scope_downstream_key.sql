-- 0015: downstream keys are derived from the scope (tenant, subject, tool and
-- the caller's key) under the ledger's salt (`dk3_…`), so an operation made
-- again for the same scope reaches the downstream under the same key. Rows
-- written before keep their `dk2_…` key (derived from the operation); the rowid
-- of the last of them is recorded, and any other key on a later row is a
-- finding of `toolgate audit`.
INSERT OR REPLACE INTO meta (key, value)
VALUES ('dk2_downstream_keys_until_rowid', CAST((SELECT coalesce(max(rowid), 0) FROM operations) AS TEXT));
