-- 0004: resilience policies (docs/design.md §11). Their state lives in the database, not
-- in a process: every dispatcher process that shares the ledger also shares the
-- downstreams, so it must share one retry budget per tool and one circuit
-- breaker per downstream. Every change happens inside the writer's
-- `BEGIN IMMEDIATE` transaction (claim, persist), so two processes never both
-- take the last token or both become the half-open probe.

-- Retry budget: a token bucket per tool, in thousandths of a token. Each first
-- attempt deposits the tool's ratio (200 = 0.2 token), each automatic retry
-- withdraws 1000, and the bucket never holds more than its capacity. Over any
-- period, retries add at most `ratio` of the first-attempt load, plus the burst.
-- A missing row is a full bucket.
CREATE TABLE retry_budgets (
    tool           TEXT PRIMARY KEY,
    tokens_milli   INTEGER NOT NULL CHECK (tokens_milli >= 0),
    capacity_milli INTEGER NOT NULL CHECK (capacity_milli >= 0),
    -- retries the budget allowed / refused, for all time (metrics)
    retries        INTEGER NOT NULL DEFAULT 0 CHECK (retries >= 0),
    refused        INTEGER NOT NULL DEFAULT 0 CHECK (refused >= 0),
    updated_at     INTEGER NOT NULL
) STRICT;

-- Circuit breaker per downstream: closed → open after N consecutive transient
-- failures → half_open (one probe) after the cool-down → closed on a healthy
-- reply, open again on a failing one. A missing row is a closed circuit.
CREATE TABLE circuits (
    downstream           TEXT PRIMARY KEY,
    state                TEXT NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    consecutive_failures INTEGER NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    -- open: no call before this instant
    open_until           INTEGER,
    -- half_open: the operation sending the probe, and until when its slot is held
    probe_operation      TEXT,
    probe_until          INTEGER,
    -- for all time (metrics)
    opened_total         INTEGER NOT NULL DEFAULT 0 CHECK (opened_total >= 0),
    refused_total        INTEGER NOT NULL DEFAULT 0 CHECK (refused_total >= 0),
    updated_at           INTEGER NOT NULL,
    CHECK ((state = 'open') = (open_until IS NOT NULL)),
    CHECK ((state = 'half_open') = (probe_until IS NOT NULL))
) STRICT;
