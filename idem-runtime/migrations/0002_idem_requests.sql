-- The idempotency records of #[idempotent]: one row per (scope, key).
CREATE TABLE idem_requests (
    scope       text        NOT NULL,
    key         text        NOT NULL CHECK (octet_length(key) BETWEEN 1 AND 255),
    operation   text        NOT NULL,
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    mode        text        NOT NULL CHECK (mode IN ('local', 'external')),
    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    outcome     text        CHECK (outcome IN ('ok', 'error')),
    response    jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    lease_until timestamptz,
    PRIMARY KEY (scope, key),
    CHECK ((state = 'completed') = (outcome IS NOT NULL))
)
-- Every record is written twice (claimed, then completed), in one transaction:
-- room on the page, and no indexed column changed by the second write, let
-- that UPDATE be a heap-only (HOT) update that touches no index.
WITH (fillfactor = 80);

-- The purge walks records by expiry. Not partial on state: a predicate on
-- state would make completing a record a non-HOT update.
CREATE INDEX idem_requests_expiry ON idem_requests (expires_at);

COMMENT ON TABLE idem_requests IS 'idem: one record per idempotency key; the primary key is the arbiter of who runs a request';
COMMENT ON COLUMN idem_requests.scope IS 'the key space (JSON of the scope values, e.g. [tenant, user]); keys of different scopes never meet';
COMMENT ON COLUMN idem_requests.key IS 'the idempotency key, given by the caller or derived as sha256(scope:operation:fingerprint)';
COMMENT ON COLUMN idem_requests.operation IS 'what was requested (by default the function path): the same key for another operation is a mismatch';
COMMENT ON COLUMN idem_requests.fingerprint IS 'sha256 of the canonical encoding (idem-fp-v1) of the request fields';
COMMENT ON COLUMN idem_requests.mode IS 'local: claim and effects commit together; external: the claim committed before an outside call';
COMMENT ON COLUMN idem_requests.state IS 'in_progress (external claim held), completed (response stored), unknown (an outside call may have happened)';
COMMENT ON COLUMN idem_requests.outcome IS 'ok: response is the stored return value; error: response is a stored final error';
COMMENT ON COLUMN idem_requests.response IS 'the stored response replayed to later requests with the same key (JSON, size-bounded)';
COMMENT ON COLUMN idem_requests.created_at IS 'when the claim was taken';
COMMENT ON COLUMN idem_requests.updated_at IS 'when the record last changed state';
COMMENT ON COLUMN idem_requests.expires_at IS 'after this a completed record may be purged and its key is new again';
COMMENT ON COLUMN idem_requests.lease_until IS 'external mode: an in-progress claim past this time is reported as outcome unknown';
