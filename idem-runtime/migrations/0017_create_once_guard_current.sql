-- idem migration 0017: create_once's guard reads the indexes as they are
-- now, not as an older snapshot saw them.
--
-- The guard of migration 16 found the key's unique index with a query on
-- pg_index, which reads the catalog through the statement's snapshot (at
-- REPEATABLE READ and SERIALIZABLE the transaction's, at READ COMMITTED one
-- taken before the INSERT waited for its table's lock). PostgreSQL plans,
-- and ON CONFLICT consults the indexes, with the catalog as it is now. So
-- an index dropped after that snapshot was taken (a transaction that had
-- already read something, or an INSERT that waited behind the DROP INDEX)
-- still passed the guard, and the INSERT wrote a second row under a key
-- already taken. The same with DROP INDEX CONCURRENTLY, whose index stays
-- in the catalog, no longer maintained, until the drop ends.
--
-- Now an index counts only when the row of pg_index the snapshot shows is
-- still the catalog's own: the index is still there (pg_get_indexdef reads
-- it through the system cache, which is current), and no transaction that
-- committed after the snapshot has replaced or deleted that row (its xmax,
-- unless the snapshot sees it committed: then it only locked the row, as a
-- SELECT .. FOR SHARE of pg_index does, and such a lock stays on the row;
-- a DROP INDEX CONCURRENTLY changes the row twice before it drops it, a
-- REINDEX CONCURRENTLY swaps it). When the snapshot saw such an index and the
-- catalog has changed it since, the guard raises a serialization failure
-- (40001): nothing is written, and the retry loop replays the transaction,
-- whose fresh snapshot then sees the index as it is (a rebuilt one passes,
-- a dropped one is refused, IDR03). An index created after the snapshot is
-- not seen until the next statement (READ COMMITTED) or transaction: the
-- guard refuses (IDR03) until then, and writes nothing.
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
    candidate record;
    xmax8 xid8;
    stale boolean := false;
    -- The snapshot's horizon as a 64-bit transaction id, to read a row's
    -- 32-bit xmax in its epoch (it lies within 2^31 of the horizon either
    -- way) for pg_xact_status.
    horizon bigint := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
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
    FOR candidate IN
        SELECT i.indexrelid, i.xmax
        FROM pg_index i
        WHERE i.indrelid = tbl
          AND i.indisunique AND i.indisvalid AND i.indimmediate
          AND i.indpred IS NULL AND i.indexprs IS NULL
          AND i.indnkeyatts = cardinality(cols)
          AND (SELECT array_agg(DISTINCT a.attname::text ORDER BY a.attname::text)
               FROM generate_series(0, i.indnkeyatts - 1) AS k
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k])
              = (SELECT array_agg(DISTINCT c ORDER BY c) FROM unnest(cols) AS c)
    LOOP
        xmax8 := (horizon
                  + (candidate.xmax::text::bigint - (horizon & 4294967295) + 6442450944) % 4294967296
                  - 2147483648)::text::xid8;
        -- Current: still in the system cache, and no transaction replaced or
        -- deleted its row after the snapshot. A committed xmax the snapshot
        -- already sees can only have locked the row (a deleter it saw would
        -- hide it), and an aborted or running one changed nothing.
        IF pg_get_indexdef(candidate.indexrelid) IS NOT NULL
           AND (candidate.xmax = '0'::xid
                OR pg_xact_status(xmax8) IS DISTINCT FROM 'committed'
                OR pg_visible_in_snapshot(xmax8, pg_current_snapshot())) THEN
            RETURN 0;
        END IF;
        stale := true;
    END LOOP;
    IF stale THEN
        -- The snapshot saw the index, the catalog has changed it since (a
        -- REINDEX CONCURRENTLY swapping it, a DROP INDEX): as for any
        -- statement whose snapshot a concurrent change overtook, the
        -- transaction is to be replayed, when a fresh snapshot tells.
        RAISE EXCEPTION 'idem: the unique index of % on (%) changed after this transaction''s snapshot was taken; replay the transaction', tbl, array_to_string(cols, ', ')
            USING ERRCODE = '40001';
    END IF;
    RAISE EXCEPTION 'idem: create_once: no unique index: % has no unique index on exactly (%), so a repeated create would not be stopped', tbl, array_to_string(cols, ', ')
        USING ERRCODE = 'IDR03',
              HINT = format('CREATE UNIQUE INDEX ON %s (%s) (not partial, not deferrable)', tbl, array_to_string(cols, ', '));
END
$$;

COMMENT ON FUNCTION idem_create_once_guard(regclass, text[]) IS
    'Folded into create_once''s INSERT when PostgreSQL plans it: 0 when the table has a unique index on exactly cols, present in the catalog as it is now (not only in an older snapshot), and no deferrable unique or exclusion constraint, else SQLSTATE IDR03.';
