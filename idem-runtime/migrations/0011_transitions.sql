-- The last guarded transition of each row (idem_runtime::versioned,
-- `.transition(from, to)`): what tells a repeated transition from another
-- write that left the row looking the same. A transition that matches no row
-- is a duplicate only if the row is in its target state at the expected
-- version + 1 and this table says that version was written by the same edge.
-- Written by the transition's own statement (a data-modifying WITH around its
-- UPDATE), so a record exists exactly when its write committed; one row per
-- model row, replaced by each later transition of it.
CREATE TABLE idem_transitions (
    table_name  text        NOT NULL,
    identity    jsonb       NOT NULL,
    version     bigint      NOT NULL,
    from_state  text        NOT NULL,
    to_state    text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (table_name, identity)
);

COMMENT ON TABLE idem_transitions IS 'idem versioned: the last .transition(from, to) each row made, written by the transition''s own statement; what tells a repeated transition (a duplicate) from another write that left the row in the same state at the same version';
COMMENT ON COLUMN idem_transitions.table_name IS 'the model''s table as diesel writes it in SQL (quoted, with its schema when the table! declares one)';
COMMENT ON COLUMN idem_transitions.identity IS 'the row''s tenant (unless tenant = none) and key values, as jsonb_build_array(tenant, key..)';
COMMENT ON COLUMN idem_transitions.version IS 'the version the transition wrote';
COMMENT ON COLUMN idem_transitions.from_state IS 'the state the transition left, as its text';
COMMENT ON COLUMN idem_transitions.to_state IS 'the state the transition entered, as its text';
COMMENT ON COLUMN idem_transitions.recorded_at IS 'when the transition''s transaction began; a record may be deleted once no repeat of its transition can still arrive (a repeat then answers Stale, not Duplicate)';
