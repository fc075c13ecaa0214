-- The record table as migrations 2-4 left it (before migration 15): text
-- labels under seven CHECK constraints. record_0014.sql writes to it, so
-- one run compares the two layouts.
CREATE TABLE idem_requests_0014 (
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
    owner       bytea CHECK (owner IS NULL OR octet_length(owner) = 16),
    scope_label text,
    PRIMARY KEY (scope, key),
    CHECK ((state = 'completed') = (outcome IS NOT NULL))
) WITH (fillfactor = 80);
CREATE INDEX idem_requests_0014_expiry ON idem_requests_0014 (expires_at);
