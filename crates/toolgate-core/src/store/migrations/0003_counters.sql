-- 0003: counters kept by triggers, so the console's header (counts per state,
-- effects, duplicate effects) costs the same on a million-row ledger as on an
-- empty one. Triggers run inside the writer's transaction: every process that
-- writes keeps them right.

CREATE TABLE state_counts (
    state TEXT PRIMARY KEY,
    n     INTEGER NOT NULL
) STRICT;

INSERT INTO state_counts (state, n) SELECT state, count(*) FROM operations GROUP BY state;

CREATE TRIGGER state_counts_insert AFTER INSERT ON operations
BEGIN
    INSERT OR IGNORE INTO state_counts (state, n) VALUES (NEW.state, 0);
    UPDATE state_counts SET n = n + 1 WHERE state = NEW.state;
END;

CREATE TRIGGER state_counts_update AFTER UPDATE OF state ON operations WHEN OLD.state IS NOT NEW.state
BEGIN
    UPDATE state_counts SET n = n - 1 WHERE state = OLD.state;
    INSERT OR IGNORE INTO state_counts (state, n) VALUES (NEW.state, 0);
    UPDATE state_counts SET n = n + 1 WHERE state = NEW.state;
END;

CREATE TRIGGER state_counts_delete AFTER DELETE ON operations
BEGIN
    UPDATE state_counts SET n = n - 1 WHERE state = OLD.state;
END;

CREATE TABLE intent_effects (
    intent TEXT PRIMARY KEY,
    n      INTEGER NOT NULL
) STRICT;

INSERT INTO intent_effects (intent, n) SELECT intent, count(*) FROM provider_effects GROUP BY intent;

CREATE TABLE effect_totals (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    effects     INTEGER NOT NULL,
    duplicates  INTEGER NOT NULL
) STRICT;

INSERT INTO effect_totals (id, effects, duplicates)
VALUES (1, (SELECT count(*) FROM provider_effects), (SELECT count(*) FROM intent_effects WHERE n > 1));

CREATE TRIGGER effect_totals_insert AFTER INSERT ON provider_effects
BEGIN
    INSERT OR IGNORE INTO intent_effects (intent, n) VALUES (NEW.intent, 0);
    UPDATE intent_effects SET n = n + 1 WHERE intent = NEW.intent;
    UPDATE effect_totals SET effects = effects + 1,
        duplicates = duplicates + ((SELECT n FROM intent_effects WHERE intent = NEW.intent) = 2)
    WHERE id = 1;
END;
