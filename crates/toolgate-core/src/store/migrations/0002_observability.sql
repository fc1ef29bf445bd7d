-- 0002: observability. The trace columns metrics slice by, an index for
-- `toolgate trace --since`, and rollups that a trigger keeps in the same
-- transaction as every trace insert, so that computing metrics never scans the
-- whole trace: every process reading the database sees the same numbers.

-- Which API call an event answers ('dispatch', 'query', 'approve'), on exactly
-- one event per call; NULL on every other step.
ALTER TABLE trace_events ADD COLUMN answer TEXT;
-- The whole call's latency as its caller saw it, on answer events.
ALTER TABLE trace_events ADD COLUMN latency_us INTEGER;
-- Salted hash of the tenant (never the tenant itself).
ALTER TABLE trace_events ADD COLUMN tenant_ref TEXT;
-- Tool contract revisions as 'input.output.effect'.
ALTER TABLE trace_events ADD COLUMN tool_version TEXT;
-- Where a timeout happened: before_send, connect, response, handler.
ALTER TABLE trace_events ADD COLUMN timeout_stage TEXT;
-- A low-cardinality classification of the step's decision (replay, retry,
-- attempts_exhausted, reconciled, ...). Never free text.
ALTER TABLE trace_events ADD COLUMN reason TEXT;

-- Events written before this migration kept these in `fields`.
UPDATE trace_events SET
    tenant_ref    = json_extract(fields, '$.tenant_ref'),
    timeout_stage = json_extract(fields, '$.timeout_stage'),
    tool_version  = CASE WHEN json_extract(fields, '$.revisions') IS NOT NULL THEN
                        json_extract(fields, '$.revisions.input') || '.' ||
                        json_extract(fields, '$.revisions.output') || '.' ||
                        json_extract(fields, '$.revisions.effect')
                    END;

CREATE INDEX trace_at ON trace_events (at, seq);

-- Every event, counted per series, for all time (Prometheus counters). Absent
-- dimensions are '' so that the primary key (and the upsert) sees them as equal.
CREATE TABLE metric_totals (
    answer         TEXT NOT NULL,
    step           TEXT NOT NULL,
    tool           TEXT NOT NULL,
    tenant_ref     TEXT NOT NULL,
    tool_version   TEXT NOT NULL,
    code           TEXT NOT NULL,
    outcome        TEXT NOT NULL,
    delivery       TEXT NOT NULL,
    timeout_stage  TEXT NOT NULL,
    reason         TEXT NOT NULL,
    events         INTEGER NOT NULL,
    latency_sum_us INTEGER NOT NULL,
    PRIMARY KEY (answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
) STRICT, WITHOUT ROWID;

-- The same, per minute (`at / 60000`): rates over a window, sparklines.
CREATE TABLE metric_minutes (
    minute         INTEGER NOT NULL,
    answer         TEXT NOT NULL,
    step           TEXT NOT NULL,
    tool           TEXT NOT NULL,
    tenant_ref     TEXT NOT NULL,
    tool_version   TEXT NOT NULL,
    code           TEXT NOT NULL,
    outcome        TEXT NOT NULL,
    delivery       TEXT NOT NULL,
    timeout_stage  TEXT NOT NULL,
    reason         TEXT NOT NULL,
    events         INTEGER NOT NULL,
    latency_sum_us INTEGER NOT NULL,
    PRIMARY KEY (minute, answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason)
) STRICT, WITHOUT ROWID;

-- Latency of answered calls as a histogram. `bucket_us` is the latency rounded
-- UP to three significant digits (exact below 1 ms), so a percentile read from
-- it is within 1% of the true one, and the Prometheus `le` bounds (1-2.5-5
-- series) fall on bucket edges: their counts are exact.
CREATE TABLE latency_totals (
    answer       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    tenant_ref   TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    bucket_us    INTEGER NOT NULL,
    count        INTEGER NOT NULL,
    PRIMARY KEY (answer, tool, tenant_ref, tool_version, bucket_us)
) STRICT, WITHOUT ROWID;

CREATE TABLE latency_minutes (
    minute       INTEGER NOT NULL,
    answer       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    tenant_ref   TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    bucket_us    INTEGER NOT NULL,
    count        INTEGER NOT NULL,
    PRIMARY KEY (minute, answer, tool, tenant_ref, tool_version, bucket_us)
) STRICT, WITHOUT ROWID;

-- Backfill from the events already there (none of them is an answer yet).
INSERT INTO metric_totals
SELECT coalesce(answer, ''), step, coalesce(tool, ''), coalesce(tenant_ref, ''), coalesce(tool_version, ''),
       coalesce(code, ''), coalesce(outcome, ''), coalesce(delivery, ''), coalesce(timeout_stage, ''),
       coalesce(reason, ''), count(*), coalesce(sum(latency_us), 0)
FROM trace_events
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10;

INSERT INTO metric_minutes
SELECT at / 60000, coalesce(answer, ''), step, coalesce(tool, ''), coalesce(tenant_ref, ''),
       coalesce(tool_version, ''), coalesce(code, ''), coalesce(outcome, ''), coalesce(delivery, ''),
       coalesce(timeout_stage, ''), coalesce(reason, ''), count(*), coalesce(sum(latency_us), 0)
FROM trace_events
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11;

-- The rollups commit or roll back with the event itself.
CREATE TRIGGER trace_events_rollup AFTER INSERT ON trace_events
BEGIN
    INSERT INTO metric_totals VALUES (
        coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
        coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
        coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
        1, coalesce(NEW.latency_us, 0))
    ON CONFLICT DO UPDATE SET events = events + 1, latency_sum_us = latency_sum_us + excluded.latency_sum_us;

    INSERT INTO metric_minutes VALUES (
        NEW.at / 60000, coalesce(NEW.answer, ''), NEW.step, coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
        coalesce(NEW.tool_version, ''), coalesce(NEW.code, ''), coalesce(NEW.outcome, ''),
        coalesce(NEW.delivery, ''), coalesce(NEW.timeout_stage, ''), coalesce(NEW.reason, ''),
        1, coalesce(NEW.latency_us, 0))
    ON CONFLICT DO UPDATE SET events = events + 1, latency_sum_us = latency_sum_us + excluded.latency_sum_us;

    -- (A SELECT with a WHERE clause: the form SQLite's upsert grammar needs.)
    INSERT INTO latency_totals
    SELECT coalesce(NEW.answer, ''), coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
           coalesce(NEW.tool_version, ''),
           CASE
               WHEN NEW.latency_us < 1000 THEN max(NEW.latency_us, 0)
               WHEN NEW.latency_us < 10000 THEN (NEW.latency_us + 9) / 10 * 10
               WHEN NEW.latency_us < 100000 THEN (NEW.latency_us + 99) / 100 * 100
               WHEN NEW.latency_us < 1000000 THEN (NEW.latency_us + 999) / 1000 * 1000
               WHEN NEW.latency_us < 10000000 THEN (NEW.latency_us + 9999) / 10000 * 10000
               WHEN NEW.latency_us < 100000000 THEN (NEW.latency_us + 99999) / 100000 * 100000
               WHEN NEW.latency_us < 1000000000 THEN (NEW.latency_us + 999999) / 1000000 * 1000000
               ELSE (min(NEW.latency_us, 999000000000) + 9999999) / 10000000 * 10000000
           END,
           1
    WHERE NEW.answer IS NOT NULL AND NEW.latency_us IS NOT NULL
    ON CONFLICT DO UPDATE SET count = count + 1;

    INSERT INTO latency_minutes
    SELECT NEW.at / 60000, coalesce(NEW.answer, ''), coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
           coalesce(NEW.tool_version, ''),
           CASE
               WHEN NEW.latency_us < 1000 THEN max(NEW.latency_us, 0)
               WHEN NEW.latency_us < 10000 THEN (NEW.latency_us + 9) / 10 * 10
               WHEN NEW.latency_us < 100000 THEN (NEW.latency_us + 99) / 100 * 100
               WHEN NEW.latency_us < 1000000 THEN (NEW.latency_us + 999) / 1000 * 1000
               WHEN NEW.latency_us < 10000000 THEN (NEW.latency_us + 9999) / 10000 * 10000
               WHEN NEW.latency_us < 100000000 THEN (NEW.latency_us + 99999) / 100000 * 100000
               WHEN NEW.latency_us < 1000000000 THEN (NEW.latency_us + 999999) / 1000000 * 1000000
               ELSE (min(NEW.latency_us, 999000000000) + 9999999) / 10000000 * 10000000
           END,
           1
    WHERE NEW.answer IS NOT NULL AND NEW.latency_us IS NOT NULL
    ON CONFLICT DO UPDATE SET count = count + 1;
END;
