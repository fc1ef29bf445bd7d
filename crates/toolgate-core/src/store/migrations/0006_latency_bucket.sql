-- 0006: the latency bucket of an answer event is computed once, in Rust
-- (`store::latency_bucket::bucket_upper`), and stored beside the latency; the
-- rollup trigger reads it instead of repeating the rounding rule in SQL twice.

ALTER TABLE trace_events ADD COLUMN latency_bucket_us INTEGER;

DROP TRIGGER trace_events_rollup;

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
           coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, 1
    WHERE NEW.answer IS NOT NULL AND NEW.latency_bucket_us IS NOT NULL
    ON CONFLICT DO UPDATE SET count = count + 1;

    INSERT INTO latency_minutes
    SELECT NEW.at / 60000, coalesce(NEW.answer, ''), coalesce(NEW.tool, ''), coalesce(NEW.tenant_ref, ''),
           coalesce(NEW.tool_version, ''), NEW.latency_bucket_us, 1
    WHERE NEW.answer IS NOT NULL AND NEW.latency_bucket_us IS NOT NULL
    ON CONFLICT DO UPDATE SET count = count + 1;
END;
