-- PostgreSQL 0004: no row that every writer updates.
--
-- Under SERIALIZABLE two concurrent transactions that update one row cannot
-- both commit: the second fails and is run again (store/pg.rs). Every write
-- step used to update the same few rows: the trace's gapless sequence
-- (max(seq) + 1), the per-state counters, and the metric and latency rollups
-- (one row per series). So concurrent dispatchers on distinct intents
-- serialized on them through retries.
--
-- Now each of those is split into slots. A writing connection holds a slot of
-- its own for its lifetime (the store takes it when it connects: a session
-- advisory lock on (SLOT_LOCK, slot), the first of 0..63 nobody holds, set as
-- `toolgate.slot`; see `pg::SLOT_CLAIM`), and the triggers touch only rows of
-- that slot. A session without one (psql, more than 64 writers) falls back to
-- its backend pid modulo 64: still correct, only no longer free of conflicts.
-- Readers add the slots up (`sum(...) GROUP BY` the series), which on SQLite's
-- unsplit tables reads the same. Everything that was counted before moves to
-- slot 0.

CREATE FUNCTION toolgate_slot() RETURNS INT LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('toolgate.slot', true), '')::int, pg_backend_pid() % 64)
$$;

-- ------------------------------------------------------- counters and rollups

ALTER TABLE state_counts ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE state_counts DROP CONSTRAINT state_counts_pkey;
ALTER TABLE state_counts ADD PRIMARY KEY (state, slot);

ALTER TABLE metric_totals ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE metric_totals DROP CONSTRAINT metric_totals_pkey;
ALTER TABLE metric_totals
    ADD PRIMARY KEY (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason, slot);

ALTER TABLE metric_minutes ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE metric_minutes DROP CONSTRAINT metric_minutes_pkey;
ALTER TABLE metric_minutes
    ADD PRIMARY KEY (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason, slot);

ALTER TABLE latency_totals ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE latency_totals DROP CONSTRAINT latency_totals_pkey;
ALTER TABLE latency_totals ADD PRIMARY KEY (answer, tool, tenant_ref, tool_version, bucket_us, slot);

ALTER TABLE latency_minutes ADD COLUMN slot INT NOT NULL DEFAULT 0;
ALTER TABLE latency_minutes DROP CONSTRAINT latency_minutes_pkey;
ALTER TABLE latency_minutes ADD PRIMARY KEY (minute, answer, tool, tenant_ref, tool_version, bucket_us, slot);

-- A slot's count of a state can go below zero (an operation counted in one
-- slot leaves its state in another); only the sum over slots is a count.
CREATE OR REPLACE FUNCTION state_counts_keep() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    s INT := toolgate_slot();
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        INSERT INTO state_counts (state, slot, n) VALUES (OLD.state, s, -1)
        ON CONFLICT (state, slot) DO UPDATE SET n = state_counts.n - 1;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO state_counts (state, slot, n) VALUES (NEW.state, s, 1)
        ON CONFLICT (state, slot) DO UPDATE SET n = state_counts.n + 1;
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION trace_events_rollup() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    s INT := NEW.slot;
BEGIN
    INSERT INTO metric_totals (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery,
                               timeout_stage, reason, slot, events, latency_sum_us)
    VALUES (coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
            coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
            coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
            s, 1, coalesce(NEW.latency_us, 0))
    ON CONFLICT (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason, slot)
    DO UPDATE SET events = metric_totals.events + 1,
                  latency_sum_us = metric_totals.latency_sum_us + excluded.latency_sum_us;

    INSERT INTO metric_minutes (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery,
                                timeout_stage, reason, slot, events, latency_sum_us)
    VALUES (NEW.at / 60000, coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
            coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
            coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
            s, 1, coalesce(NEW.latency_us, 0))
    ON CONFLICT (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason, slot)
    DO UPDATE SET events = metric_minutes.events + 1,
                  latency_sum_us = metric_minutes.latency_sum_us + excluded.latency_sum_us;

    IF NEW.answer IS NOT NULL AND NEW.latency_bucket_us IS NOT NULL THEN
        INSERT INTO latency_totals (answer, tool, tenant_ref, tool_version, bucket_us, slot, count)
        VALUES (NEW.answer, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
                coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, s, 1)
        ON CONFLICT (answer, tool, tenant_ref, tool_version, bucket_us, slot)
        DO UPDATE SET count = latency_totals.count + 1;

        INSERT INTO latency_minutes (minute, answer, tool, tenant_ref, tool_version, bucket_us, slot, count)
        VALUES (NEW.at / 60000, NEW.answer, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
                coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, s, 1)
        ON CONFLICT (minute, answer, tool, tenant_ref, tool_version, bucket_us, slot)
        DO UPDATE SET count = latency_minutes.count + 1;
    END IF;
    RETURN NULL;
END $$;

-- --------------------------------------------------------- the trace's order
--
-- `seq` was max(seq) + 1 under the transaction's snapshot: gapless, and the
-- one number every writer read and wrote. It now comes from the column's own
-- sequence, which never blocks and leaves a gap for every rolled-back insert;
-- the "no event was deleted" check moves to a gapless number per slot
-- (`slot_seq`, 1, 2, 3, ... in each slot, kept in `trace_slots` by the insert's
-- own transaction). Events written before this migration keep their gapless
-- `seq` and have no slot.

ALTER TABLE trace_events ADD COLUMN slot INT, ADD COLUMN slot_seq BIGINT;

CREATE TABLE trace_slots (
    slot INT PRIMARY KEY,
    last BIGINT NOT NULL
);

CREATE UNIQUE INDEX trace_by_slot ON trace_events (slot, slot_seq) WHERE slot IS NOT NULL;

SELECT setval(pg_get_serial_sequence('trace_events', 'seq'), coalesce(max(seq), 0) + 1, false) FROM trace_events;

CREATE FUNCTION trace_events_slot() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.slot := toolgate_slot();
    INSERT INTO trace_slots (slot, last) VALUES (NEW.slot, 1)
    ON CONFLICT (slot) DO UPDATE SET last = trace_slots.last + 1
    RETURNING last INTO NEW.slot_seq;
    RETURN NEW;
END $$;
CREATE TRIGGER trace_events_slot BEFORE INSERT ON trace_events
    FOR EACH ROW EXECUTE FUNCTION trace_events_slot();
