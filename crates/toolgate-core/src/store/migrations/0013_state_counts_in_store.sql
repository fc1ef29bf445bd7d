-- 0013: the counts per state (migration 0003) are kept by the store's own
-- statements instead of triggers (issue 18 §3): `Tx::insert_operation`,
-- `Tx::update_operation` and `Tx::purge_operation` add to `state_counts` in
-- the same transaction, so the counts stay exactly as current as they were.
-- The triggers cost more than their three small writes: a statement that
-- fires a trigger may have to undo part of its work, so SQLite opened a
-- statement journal for every insert and every change of state of an
-- operation, copying each of the twenty-odd index pages it touched (~170 k
-- instructions per fresh dispatch, 8 %). Every SQLite write of `operations`
-- goes through those three functions. A hand edit of the state column is no
-- longer counted: `toolgate audit` reports counts that disagree with the rows
-- (check `counts`). (SQLite only: PostgreSQL keeps its slot triggers.)
DROP TRIGGER state_counts_insert;
DROP TRIGGER state_counts_update;
DROP TRIGGER state_counts_delete;
