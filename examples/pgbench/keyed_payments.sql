-- The table of bench_idempotent's business_key contender: the payment's
-- columns, its version, and the idempotency key unique on the row itself.
-- Load it into a database that has examples/pgbench/schema.sql's tables.
CREATE TABLE bench_idempotent_keyed_payments (
    id        bigint PRIMARY KEY,
    order_key text   NOT NULL UNIQUE,
    amount    bigint NOT NULL,
    currency  text   NOT NULL,
    merchant  text   NOT NULL,
    version   bigint NOT NULL DEFAULT 0
);
