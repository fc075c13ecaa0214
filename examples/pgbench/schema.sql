-- The tables of examples/bench_idempotent: the handler's payment row and
-- outbox row.
CREATE TABLE bench_idempotent_payments (
    id        bigint PRIMARY KEY,
    order_key text   NOT NULL,
    amount    bigint NOT NULL,
    currency  text   NOT NULL,
    merchant  text   NOT NULL
);
CREATE TABLE bench_idempotent_outbox (
    id            bigserial PRIMARY KEY,
    event_key     text  NOT NULL UNIQUE,
    aggregate_key text  NOT NULL,
    event_type    text  NOT NULL,
    payload       jsonb NOT NULL
);
