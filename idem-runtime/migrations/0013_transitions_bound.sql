-- idem migration 0013: bind every record of idem_transitions to the table
-- as the server resolved it, and to the very write that made the row's
-- version.
--
-- A record of migration 11 was keyed by the table's SQL text, so two tables
-- of one name in two schemas (one unqualified diesel table reached through
-- search_path, a schema per tenant) shared records; and it named a version,
-- which repeats when a key's versions start again (TRUNCATE, tombstones
-- purged sooner than records, a delete and re-insert without the backstop).
-- Both let a transition that matched no row be answered Duplicate for a row
-- that never made it.
--
-- A record now names the table by its oid (table_oid, a regclass the
-- transition's own statement resolves under its search_path) and holds the
-- full id of the (sub)transaction that wrote the row version (row_xid: the
-- new row version's xmin, returned by the transition's UPDATE, widened to 64
-- bits). A repeat is a duplicate only if the row's current xmin is that
-- write's: any later write of the row, or a row inserted again, has another.
--
-- Records of migration 11 (table_name set, table_oid and row_xid null) are
-- kept for instances of an earlier build still running during a rolling
-- deploy: they key on (table_name, identity), which stays unique. This build
-- never reads them (null matches nothing) and writes table_name null. Once
-- no earlier build runs:
--   DELETE FROM idem_transitions WHERE table_oid IS NULL;
ALTER TABLE idem_transitions
    DROP CONSTRAINT idem_transitions_pkey,
    ALTER COLUMN table_name DROP NOT NULL,
    ADD COLUMN table_oid regclass,
    ADD COLUMN row_xid bigint,
    ADD CONSTRAINT idem_transitions_table_name_identity_key UNIQUE (table_name, identity),
    ADD CONSTRAINT idem_transitions_table_oid_identity_key UNIQUE (table_oid, identity),
    ADD CONSTRAINT idem_transitions_bound CHECK (
        (table_oid IS NULL) = (row_xid IS NULL)
        AND (table_oid IS NULL) <> (table_name IS NULL)
    );

COMMENT ON TABLE idem_transitions IS 'idem versioned: the last .transition(from, to) each row made, written by the transition''s own statement and bound to the write it made (table_oid, row_xid); what tells a repeated transition (a duplicate) from another write that left the row in the same state at the same version';
COMMENT ON COLUMN idem_transitions.table_name IS 'records of an earlier build (migration 11) only: the model''s table as diesel writes it in SQL; null in records this build writes, which name the table by table_oid';
COMMENT ON COLUMN idem_transitions.table_oid IS 'the model''s table as the transition''s statement resolved it (under its search_path): two schemas never share records, and a table dropped and created again is another table';
COMMENT ON COLUMN idem_transitions.row_xid IS 'the full (epoch and xid) id of the transaction or subtransaction that wrote the row version, its xmin as the UPDATE returned it; a repeat is a duplicate only while the row''s xmin is still this one';
