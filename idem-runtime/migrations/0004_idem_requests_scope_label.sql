-- From idem 0.3 the scope column holds the hex SHA-256 of the scope's
-- canonical encoding (one logical scope is one key space whatever the order
-- of its maps, and a scope of any size fits the primary key). The readable
-- form moves beside it, kept only when short, for people reading the table.
ALTER TABLE idem_requests ADD COLUMN scope_label text;

-- Records written before: their scope was the compact JSON itself.
UPDATE idem_requests SET scope_label = scope WHERE octet_length(scope) <= 200;

COMMENT ON COLUMN idem_requests.scope_label IS 'the scope as compact JSON when at most 200 bytes, else NULL; informational only (the scope column, a hash, is what is compared)';
COMMENT ON COLUMN idem_requests.scope IS 'the key space: hex SHA-256 of the canonical encoding of the scope values (idem-scope-v1); records from idem 0.2 hold the compact JSON instead';
