-- The providers' SQLite 0002: the effect counters of 0001 (`intent_effects`,
-- `effect_totals`) are kept by `ProviderTx::insert_provider_effect` in the
-- same transaction instead of a trigger. A statement that fires a trigger
-- opens a statement journal and copies every page it touches into it (~80 k
-- instructions per committed effect). Every write of `provider_effects` goes
-- through that function. (PostgreSQL keeps its trigger, pg_0002.)
DROP TRIGGER IF EXISTS effect_totals_insert;
