-- idem migration 0012: the replay cache's secret.
--
-- The Redis replay cache authenticates every entry with an HMAC whose key is
-- derived from this secret and from what identifies this database's life
-- (its oid, the server's start time, the records table's identity; see
-- idem_runtime::idempotency::ReplayCache). Someone who can only write to
-- Redis cannot make an entry the cache accepts, and a database recreated,
-- migrated from scratch (a new secret) or restored (a restart, a new table)
-- invalidates every entry made before.
--
-- 244 random bits: two version-4 UUIDs (gen_random_uuid is built in since
-- PostgreSQL 13). Rotating it invalidates every entry:
--   UPDATE idem_cache_secret SET secret = decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');
CREATE TABLE idem_cache_secret (
    only_row   boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    secret     bytea       NOT NULL CHECK (octet_length(secret) = 32),
    created_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO idem_cache_secret (secret)
VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));

COMMENT ON TABLE idem_cache_secret IS
    'idem: the secret the Redis replay cache''s entries are authenticated with (one row). Readable only by the application''s role; rotate it to invalidate every entry.';
