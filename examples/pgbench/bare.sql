-- The bare handler: BEGIN with its settings (one round trip), the payment
-- row, the outbox row, COMMIT.
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
\endpipeline
INSERT INTO bench_idempotent_payments (id, order_key, amount, currency, merchant) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo');
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
COMMIT;
