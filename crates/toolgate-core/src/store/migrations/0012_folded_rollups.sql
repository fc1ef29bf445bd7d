-- 0012: the trace rollups of migrations 0002 and 0006 are folded in batches
-- instead of by a trigger on every trace insert (issue 18 §3). The trigger ran
-- four upserts per event and wrote the rollup pages in every commit; a fold
-- runs the same rule once over a few hundred events, in the transaction of
-- the insert whose `seq` is a multiple of the batch (store/mod.rs,
-- `Tx::fold_rollups`). Events past `folded_seq` are the unfolded tail, which
-- every reader adds to the rollups, so every reader still sees every event.
-- (SQLite only: `seq` is the rowid, so events commit in `seq` order and the
-- tail is exactly `seq > folded_seq`. PostgreSQL keeps its slot triggers.)
DROP TRIGGER trace_events_rollup;

CREATE TABLE rollup_mark (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    -- Every trace event with seq <= folded_seq is counted in the rollups.
    folded_seq INTEGER NOT NULL CHECK (folded_seq >= 0)
) STRICT;

-- Until now the trigger counted every event as it was inserted.
INSERT INTO rollup_mark (id, folded_seq) VALUES (1, (SELECT coalesce(max(seq), 0) FROM trace_events));

