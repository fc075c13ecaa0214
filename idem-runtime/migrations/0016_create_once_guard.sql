-- idem migration 0016: the guard of create_once's INSERT.
--
-- create_once inserts with `ON CONFLICT DO NOTHING` and no conflict target
-- (so a racer meeting the winner on another unique column waits and writes
-- nothing), which means PostgreSQL no longer proves that the key has a
-- unique index. This function proves it instead. The INSERT writes the new
-- row's version as `idem_create_once_guard('<table>'::regclass, '{cols}')`:
-- both arguments are constants and the function is declared IMMUTABLE, so
-- PostgreSQL evaluates it once, when it plans the statement, and keeps the 0
-- it returns in the plan. It plans the statement again whenever the table's
-- indexes change (an index created, dropped, or created in a transaction
-- that rolled back) and whenever the search_path changes the table the name
-- resolves to, so the check follows every such change and costs nothing on
-- the executions between. (IMMUTABLE is a promise about that plan, not
-- about the catalog: the answer only changes with events that replan.)
--
-- It raises IDR03 unless the table has a unique index on exactly `cols`
-- (valid, not partial, not on expressions, not deferrable), and when the
-- table has a deferrable unique or exclusion constraint, which `ON CONFLICT`
-- refuses as an arbiter.
CREATE OR REPLACE FUNCTION idem_create_once_guard(tbl regclass, cols text[]) RETURNS integer
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
DECLARE
    deferrable_index text;
BEGIN
    SELECT i.indexrelid::regclass::text INTO deferrable_index
    FROM pg_index i
    WHERE i.indrelid = tbl AND NOT i.indimmediate AND (i.indisunique OR i.indisexclusion)
    LIMIT 1;
    IF deferrable_index IS NOT NULL THEN
        RAISE EXCEPTION 'idem: create_once: deferrable: % has the deferrable unique or exclusion constraint %, which ON CONFLICT refuses', tbl, deferrable_index
            USING ERRCODE = 'IDR03',
                  HINT = 'make the constraint NOT DEFERRABLE, or create the rows with insert';
    END IF;
    IF NOT EXISTS (
        SELECT FROM pg_index i
        WHERE i.indrelid = tbl
          AND i.indisunique AND i.indisvalid AND i.indimmediate
          AND i.indpred IS NULL AND i.indexprs IS NULL
          AND i.indnkeyatts = cardinality(cols)
          AND NOT EXISTS (
              SELECT FROM generate_series(0, i.indnkeyatts - 1) AS k
              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k]
              WHERE NOT (a.attname::text = ANY (cols)))
    ) THEN
        RAISE EXCEPTION 'idem: create_once: no unique index: % has no unique index on exactly (%), so a repeated create would not be stopped', tbl, array_to_string(cols, ', ')
            USING ERRCODE = 'IDR03',
                  HINT = format('CREATE UNIQUE INDEX ON %s (%s) (not partial, not deferrable)', tbl, array_to_string(cols, ', '));
    END IF;
    RETURN 0;
END
$$;

COMMENT ON FUNCTION idem_create_once_guard(regclass, text[]) IS
    'Folded into create_once''s INSERT when PostgreSQL plans it: 0 when the table has a unique index on exactly cols and no deferrable unique or exclusion constraint, else SQLSTATE IDR03.';
