-- The simulated providers' own tables (SQLite), created by their own store
-- (store::ProviderStore). A ledger file made before the providers had a store
-- of their own already holds them (ledger migrations 0001 and 0003): every
-- statement here is IF NOT EXISTS, so it finds them and leaves them as they are.

CREATE TABLE IF NOT EXISTS provider_effects (
    seq            INTEGER PRIMARY KEY,
    provider       TEXT NOT NULL,
    downstream_key TEXT NOT NULL,
    intent         TEXT NOT NULL,
    body_sha256    TEXT NOT NULL,
    request_id     TEXT NOT NULL,
    receipt_id     TEXT NOT NULL UNIQUE,
    result_json    TEXT NOT NULL,
    committed_at   INTEGER NOT NULL,
    visible_at     INTEGER NOT NULL
) STRICT;
CREATE INDEX IF NOT EXISTS provider_effects_key ON provider_effects (provider, downstream_key);
CREATE INDEX IF NOT EXISTS provider_effects_intent ON provider_effects (intent);

CREATE TABLE IF NOT EXISTS intent_effects (
    intent TEXT PRIMARY KEY,
    n      INTEGER NOT NULL
) STRICT;

CREATE TABLE IF NOT EXISTS effect_totals (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    effects     INTEGER NOT NULL,
    duplicates  INTEGER NOT NULL
) STRICT;
INSERT OR IGNORE INTO effect_totals (id, effects, duplicates) VALUES (1, 0, 0);

CREATE TRIGGER IF NOT EXISTS effect_totals_insert AFTER INSERT ON provider_effects
BEGIN
    INSERT OR IGNORE INTO intent_effects (intent, n) VALUES (NEW.intent, 0);
    UPDATE intent_effects SET n = n + 1 WHERE intent = NEW.intent;
    UPDATE effect_totals SET effects = effects + 1,
        duplicates = duplicates + ((SELECT n FROM intent_effects WHERE intent = NEW.intent) = 2)
    WHERE id = 1;
END;
