-- The bare handler with its payment row in the keyed table: a plain INSERT,
-- so what the table's version column and unique key index cost alone.
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
\endpipeline
INSERT INTO bench_idempotent_keyed_payments (id, order_key, amount, currency, merchant, version) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo', 0);
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
COMMIT;
