-- The providers' SQLite 0003: the payments provider's charges. A real payment
-- service refunds only what remains of the charge it captured; the simulated
-- one now does too (issue 39 A, defence in depth): a refund above what remains
-- is refused atomically (a conditional update of the charge), so a ledger
-- defect can never pay out money the order did not have. Charges are known from
-- the world the ledger was initialised with; a refund of an order the provider
-- holds no charge for is not limited (a provider started without a world).
CREATE TABLE IF NOT EXISTS provider_charges (
    provider       TEXT NOT NULL,
    order_ref      TEXT NOT NULL,
    currency       TEXT NOT NULL,
    captured_minor INTEGER NOT NULL CHECK (captured_minor >= 0),
    refunded_minor INTEGER NOT NULL CHECK (refunded_minor >= 0 AND refunded_minor <= captured_minor),
    PRIMARY KEY (provider, order_ref)
) STRICT;
