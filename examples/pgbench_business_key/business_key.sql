-- bench_idempotent's business_key contender as create_once sends it for a
-- new key: the payment row inserted with ON CONFLICT DO NOTHING (no conflict
-- target) RETURNING the row, then the outbox row. Beside examples/pgbench:
--
--   psql -f examples/pgbench/schema.sql -f examples/pgbench_business_key/keyed_payments.sql $DB
--   pgbench -M prepared -n -c 1 -j 1 -T 30 -l --log-prefix=/tmp/log \
--     -f examples/pgbench/bare.sql@1 \
--     -f examples/pgbench_business_key/keyed_plain.sql@1 \
--     -f examples/pgbench_business_key/business_key.sql@1 $DB
--
-- and the median of each script's latencies in the log (column 3, script
-- number in column 4), as examples/pgbench/run.sh computes them.
\set id random(1, 4000000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL statement_timeout = '800ms';
SET LOCAL lock_timeout = '400ms';
\endpipeline
INSERT INTO bench_idempotent_keyed_payments (id, order_key, amount, currency, merchant, version) VALUES (:id, 'pgb-' || (:id)::text, 3000, 'CNY', 'demo', 0) ON CONFLICT DO NOTHING RETURNING id, order_key, amount, currency, merchant, version;
INSERT INTO bench_idempotent_outbox (event_key, aggregate_key, event_type, payload) VALUES ('pgb:' || (:id)::text || '-created', 'pgb-' || (:id)::text, 'payment.created', '{"payment_id": 1, "order_key": "pgb", "amount": 3000, "currency": "CNY", "status": "created"}');
COMMIT;
