-- 0009: downstream keys are derived from the operation id and its status_ref
-- (`dk2_…`), so a changed key is found. Rows written before keep their random
-- `dk_…` key; the rowid of the last of them is recorded, and a `dk_` key on a
-- later row is a finding of `toolgate audit`.
INSERT OR REPLACE INTO meta (key, value)
VALUES ('legacy_downstream_keys_until_rowid', CAST((SELECT coalesce(max(rowid), 0) FROM operations) AS TEXT));
