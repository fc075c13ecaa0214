-- record_only.sql into the layout before migration 15 (layout_0014.sql):
-- what the seven CHECK constraints cost.
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
\endpipeline
INSERT INTO bench_idempotent_payments (id, order_key, amount, currency, merchant) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo');
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
\startpipeline
INSERT INTO idem_requests_0014 AS r (scope, scope_label, key, operation, fingerprint, mode, state, outcome, response, expires_at) VALUES (repeat('a', 64), NULL, 'pgb-' || (:id)::text, 'op', decode('00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff', 'hex'), 'local', 'completed', 'ok', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}', now() + 86400000000 * interval '1 microsecond');
COMMIT;
\endpipeline
