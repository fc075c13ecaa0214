-- idem migration 0017: local mode's first statements as one function.
--
-- A local request queues on the advisory lock of its scope and key, then
-- reads its record. Both ride on the transaction's BEGIN, which
-- diesel-async sends as one simple query: a statement written there is
-- parsed and planned again at every call (about 0.1 of the bare handler
-- here, measured with pgbench), where a function's statements are planned
-- once per session and their plans kept. VOLATILE, so under READ COMMITTED
-- the read takes its snapshot after the lock was granted, and sees a record
-- a duplicate committed while this request waited.
--
-- Every column comes back as text: a simple query's rows are text, and
-- bytes in hex read the same whatever bytea_output says.
CREATE OR REPLACE FUNCTION idem_local_open(lock_key bigint, request_scope text, request_key text)
RETURNS TABLE (
    operation text,
    fingerprint text,
    state text,
    outcome text,
    response text,
    lease_expired boolean,
    expired boolean,
    owner text,
    remaining_ms bigint
)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(lock_key);
    RETURN QUERY
        SELECT r.operation, encode(r.fingerprint, 'hex'), r.state::text, r.outcome::text,
               r.response::text, r.lease_until < now(), r.expires_at <= now(),
               encode(r.owner, 'hex'), (extract(epoch FROM r.expires_at - now()) * 1000)::int8
        FROM idem_requests r
        WHERE r.scope = request_scope AND r.key = request_key;
END
$$;

COMMENT ON FUNCTION idem_local_open(bigint, text, text) IS
    'Local mode''s first statements, sent with BEGIN: the advisory lock of the request''s scope and key, then the read of its record.';
