-- The providers' PostgreSQL 0002: the effect counter split into slots, as the
-- ledger's counters are (ledger migration pg/0004, where the slots are
-- explained): every provider commit used to update the one `effect_totals`
-- row, so two connections committing effects at once could not both commit.
-- The trigger now adds to the row of its session's slot; readers add the
-- slots up. What was counted moves to slot 0. `intent_effects` stays one row
-- per intent: only a duplicate of one intent updates a row another commit
-- updates, and that is exactly what it must see.

ALTER TABLE effect_totals DROP CONSTRAINT effect_totals_id_check;
ALTER TABLE effect_totals ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE effect_totals DROP CONSTRAINT effect_totals_pkey;
ALTER TABLE effect_totals ADD PRIMARY KEY (id, slot);
ALTER TABLE effect_totals ADD CHECK (id = 1);

CREATE OR REPLACE FUNCTION effect_totals_keep() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    count_now BIGINT;
BEGIN
    INSERT INTO intent_effects (intent, n) VALUES (NEW.intent, 1)
    ON CONFLICT (intent) DO UPDATE SET n = intent_effects.n + 1
    RETURNING n INTO count_now;
    INSERT INTO effect_totals (id, slot, effects, duplicates)
    VALUES (1, coalesce(nullif(current_setting('toolgate.slot', true), '')::int, pg_backend_pid() % 64), 1,
            CASE WHEN count_now = 2 THEN 1 ELSE 0 END)
    ON CONFLICT (id, slot) DO UPDATE SET effects = effect_totals.effects + 1,
        duplicates = effect_totals.duplicates + excluded.duplicates;
    RETURN NULL;
END $$;
