-- 0014: holds (issue 39 A). A rule that grants from a balance (a refund from
-- what an order has left) reserves what it grants in the transaction that
-- accepts the operation; the hold lives exactly as long as the operation may
-- still take effect. `Tx::update_operation` deletes it when the operation
-- becomes terminal (succeeded: the domain's local effect has turned it into
-- a refund in the same transaction; failed or resolved: released). While an
-- operation is unknown or under review its hold stays: the money may be gone.
-- `resource` is the domain's name for the balance (the demo world's orders:
-- `order:REF`), so the engine keeps holds without naming an order.
CREATE TABLE holds (
    operation_id TEXT PRIMARY KEY REFERENCES operations(id),
    resource     TEXT NOT NULL,
    amount       INTEGER NOT NULL CHECK (amount > 0),
    held_at      INTEGER NOT NULL
) STRICT;
CREATE INDEX holds_resource ON holds (resource);

-- Money paid above an order's capture is kept, never clipped: `refunded_minor`
-- stops at the capture (its CHECK) and what went past it is counted here, so
-- the audit, the console and the load referee can show it.
ALTER TABLE orders ADD COLUMN over_refunded_minor INTEGER NOT NULL DEFAULT 0 CHECK (over_refunded_minor >= 0);

-- A ledger written before holds existed: every refund that may still take
-- effect holds its amount from now on (the only domain with a balance then).
INSERT INTO holds (operation_id, resource, amount, held_at)
SELECT id, 'order:' || json_extract(request_json, '$.arguments.order_ref'),
       json_extract(request_json, '$.arguments.amount_minor'), updated_at
FROM operations
WHERE tool = 'create_refund' AND state NOT IN ('succeeded', 'failed', 'resolved')
  AND json_extract(request_json, '$.arguments.amount_minor') > 0;
