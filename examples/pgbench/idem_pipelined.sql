-- Local mode's round trips as idem sends them: the advisory lock and the
-- read with BEGIN, the handler, the record (a plain INSERT) with COMMIT.
-- pgbench pipelines prepared statements, as idem does: its wire replaces
-- BEGIN's and COMMIT's simple queries with extended-protocol messages.
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
SELECT pg_advisory_xact_lock(:id);
SELECT operation, fingerprint, state::text, outcome::text, response, lease_until < now(), expires_at <= now(), owner FROM idem_requests WHERE scope = repeat('a', 64) AND key = 'pgb-' || (:id)::text;
\endpipeline
INSERT INTO bench_idempotent_payments (id, order_key, amount, currency, merchant) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo');
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
\startpipeline
INSERT INTO idem_requests AS r (scope, scope_label, key, operation, fingerprint, mode, state, outcome, response, expires_at) VALUES (repeat('a', 64), NULL, 'pgb-' || (:id)::text, 'op', decode('00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff', 'hex'), 'local', 'completed', 'ok'::text::idem_request_outcome, '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}', now() + 86400000000 * interval '1 microsecond');
COMMIT;
\endpipeline
