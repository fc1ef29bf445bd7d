-- The providers' PostgreSQL 0003: the payments provider's charges, as
-- sqlite_0003 (which says why).
CREATE TABLE provider_charges (
    provider       TEXT NOT NULL,
    order_ref      TEXT NOT NULL,
    currency       TEXT NOT NULL,
    captured_minor BIGINT NOT NULL CHECK (captured_minor >= 0),
    refunded_minor BIGINT NOT NULL CHECK (refunded_minor >= 0 AND refunded_minor <= captured_minor),
    PRIMARY KEY (provider, order_ref)
);
