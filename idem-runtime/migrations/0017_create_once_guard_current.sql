-- idem migration 0017: create_once's guard reads the indexes as the planner
-- does.
--
-- The guard of migration 16 found the key's unique index with a query on
-- pg_index, which reads the catalog through the statement's snapshot (at
-- REPEATABLE READ and SERIALIZABLE the transaction's, at READ COMMITTED one
-- taken before the INSERT waited for its table's lock). PostgreSQL plans
-- with the catalog as it is now. So an index dropped after that snapshot
-- was taken (a transaction that had already read something, or an INSERT
-- that waited behind the DROP INDEX) still passed the guard, and the
-- INSERT, planned without the index, wrote a second row under a key
-- already taken. Now an index counts only when the catalog as it is now
-- still holds it (pg_get_indexdef reads it through the system cache, which
-- is current): one dropped since is refused (IDR03), as at a first call.
-- An index created after the snapshot is not seen until the next
-- statement; the guard refuses then, and writes nothing.
--
-- It also required that the index's key columns be `cols`, and checked
-- only that each key column is one of them: a unique index on (key, key),
-- with as many columns as (tenant, key), passed without covering the
-- tenant, and a key taken in another tenant answered Conflict there (its
-- existence leaked). Now every column of `cols` must be a key column too.
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
          AND pg_get_indexdef(i.indexrelid) IS NOT NULL
          AND (SELECT array_agg(DISTINCT a.attname::text ORDER BY a.attname::text)
               FROM generate_series(0, i.indnkeyatts - 1) AS k
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k])
              = (SELECT array_agg(DISTINCT c ORDER BY c) FROM unnest(cols) AS c)
    ) THEN
        RAISE EXCEPTION 'idem: create_once: no unique index: % has no unique index on exactly (%), so a repeated create would not be stopped', tbl, array_to_string(cols, ', ')
            USING ERRCODE = 'IDR03',
                  HINT = format('CREATE UNIQUE INDEX ON %s (%s) (not partial, not deferrable)', tbl, array_to_string(cols, ', '));
    END IF;
    RETURN 0;
END
$$;

COMMENT ON FUNCTION idem_create_once_guard(regclass, text[]) IS
    'Folded into create_once''s INSERT when PostgreSQL plans it: 0 when the table has a unique index on exactly cols, present in the catalog as it is now, and no deferrable unique or exclusion constraint, else SQLSTATE IDR03.';
