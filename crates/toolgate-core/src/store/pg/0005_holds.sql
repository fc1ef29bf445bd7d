-- 0005 (PostgreSQL): holds, as SQLite's migration 0014 (which says why).
CREATE TABLE holds (
    operation_id TEXT PRIMARY KEY REFERENCES operations(id),
    resource     TEXT NOT NULL,
    amount       BIGINT NOT NULL CHECK (amount > 0),
    held_at      BIGINT NOT NULL
);
CREATE INDEX holds_resource ON holds (resource);

ALTER TABLE orders ADD COLUMN over_refunded_minor BIGINT NOT NULL DEFAULT 0 CHECK (over_refunded_minor >= 0);

INSERT INTO holds (operation_id, resource, amount, held_at)
SELECT id, 'order:' || (request_json::jsonb #>> '{arguments,order_ref}'),
       (request_json::jsonb #>> '{arguments,amount_minor}')::bigint, updated_at
FROM operations
WHERE tool = 'create_refund' AND state NOT IN ('succeeded', 'failed', 'resolved')
  AND (request_json::jsonb #>> '{arguments,amount_minor}')::bigint > 0;
