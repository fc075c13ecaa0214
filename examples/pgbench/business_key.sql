-- bench_idempotent's business_key contender as create_once sends it for a
-- new key: the payment row inserted with ON CONFLICT DO NOTHING (no conflict
-- target) RETURNING the row, then the outbox row. keyed_plain is the same
-- handler with a plain INSERT into the keyed table (keyed_payments.sql).
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
\endpipeline
INSERT INTO bench_idempotent_keyed_payments (id, order_key, amount, currency, merchant, version) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo', 0) ON CONFLICT DO NOTHING RETURNING id, order_key, amount, currency, merchant, version;
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
COMMIT;
