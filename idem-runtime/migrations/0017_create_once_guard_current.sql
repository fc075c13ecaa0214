-- idem migration 0017: create_once's guard asks the planner, which sees the
-- indexes as they are now.
--
-- The guard of migration 16 found the key's unique index with queries on
-- pg_index and pg_attribute, which read the catalog through the statement's
-- snapshot (at REPEATABLE READ and SERIALIZABLE the transaction's, at READ
-- COMMITTED one taken before the INSERT waited for its table's lock).
-- PostgreSQL plans the INSERT, and ON CONFLICT consults the indexes, with
-- the catalog as it is now. So whatever changed the indexes after that
-- snapshot, and before the INSERT took its table's lock, went unseen: a
-- DROP INDEX, the phase of a DROP INDEX CONCURRENTLY where the index is no
-- longer maintained, a migration that renamed the key column away from its
-- index; the guard passed and the INSERT wrote a second row under a key
-- already taken. It also required that the index's key columns number as
-- many as `cols` and each be one of them, so a unique index on (key, key)
-- passed for (tenant, key) without covering the tenant, and a key taken in
-- another tenant answered Conflict there (its existence leaked).
--
-- Now the guard asks PostgreSQL's own question, with the catalog the INSERT
-- is planned with: would ON CONFLICT (`cols`) find an arbiter? A VOLATILE
-- helper (an IMMUTABLE function may not run EXPLAIN) plans, without running
-- it, `INSERT INTO tbl (cols) OVERRIDING SYSTEM VALUE VALUES (NULL, ..) ON
-- CONFLICT (cols) DO NOTHING`; the planner accepts it only when a valid
-- unique index has exactly `cols` as its key columns (by their names now,
-- in any order), is not partial and not on expressions, or it raises
-- 42P10, which the guard
-- turns into IDR03 (NoUniqueIndex), nothing written. The planning happens
-- under the INSERT's own lock on the table, so the index it finds is the
-- one the INSERT's ON CONFLICT then meets; an index created after the
-- snapshot is found too. The guard is still folded into the INSERT's plan:
-- it runs when PostgreSQL plans the INSERT (at a connection's first create,
-- and again after any change to the table's indexes or columns), not at
-- each execution; behind a transaction pooler, where nothing is prepared,
-- at each call. A deferrable unique or exclusion constraint on the table
-- or a partition of it is still refused first, as in migration 16 (ON
-- CONFLICT with no target raises on it at every insert).

-- Whether ON CONFLICT (`cols`) finds an arbiter on `tbl` now: NULL when it
-- does, else the planner's message.
CREATE OR REPLACE FUNCTION idem_create_once_arbiter(tbl regclass, cols text[]) RETURNS text
LANGUAGE plpgsql VOLATILE STRICT AS $$
DECLARE
    names text := (SELECT string_agg(quote_ident(c), ', ') FROM unnest(cols) AS c);
    -- NULLs, as the create gives values: a default of these columns is
    -- never planned (one that raises when folded, or calls a function the
    -- role may not run, would refuse a create that never uses it).
    nulls text := (SELECT string_agg('NULL', ', ') FROM unnest(cols) AS c);
BEGIN
    EXECUTE format('EXPLAIN (COSTS OFF) INSERT INTO %s (%s) OVERRIDING SYSTEM VALUE VALUES (%s) ON CONFLICT (%s) DO NOTHING',
                   tbl, names, nulls, names);
    RETURN NULL;
EXCEPTION WHEN invalid_column_reference THEN
    RETURN SQLERRM;
END
$$;

COMMENT ON FUNCTION idem_create_once_arbiter(regclass, text[]) IS
    'For idem_create_once_guard: plans (never runs) INSERT INTO tbl (cols) .. ON CONFLICT (cols) DO NOTHING; NULL when PostgreSQL finds the arbiter, else its message (42P10).';

CREATE OR REPLACE FUNCTION idem_create_once_guard(tbl regclass, cols text[]) RETURNS integer
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
DECLARE
    deferrable_index text;
    no_arbiter text;
BEGIN
    -- On the table or any of its partitions, and still in the catalog
    -- (pg_get_indexdef reads the system cache: one dropped since the
    -- snapshot is not held against the create). One added since is not
    -- seen here; the INSERT then fails on it, and create_once answers
    -- NoUniqueIndex for that too.
    SELECT i.indexrelid::regclass::text INTO deferrable_index
    FROM pg_index i
    WHERE (i.indrelid = tbl OR i.indrelid IN (SELECT relid FROM pg_partition_tree(tbl)))
      AND NOT i.indimmediate AND (i.indisunique OR i.indisexclusion)
      AND pg_get_indexdef(i.indexrelid) IS NOT NULL
    LIMIT 1;
    IF deferrable_index IS NOT NULL THEN
        RAISE EXCEPTION 'idem: create_once: deferrable: % has the deferrable unique or exclusion constraint %, which ON CONFLICT refuses', tbl, deferrable_index
            USING ERRCODE = 'IDR03',
                  HINT = 'make the constraint NOT DEFERRABLE, or create the rows with insert';
    END IF;
    no_arbiter := idem_create_once_arbiter(tbl, cols);
    IF no_arbiter IS NOT NULL THEN
        RAISE EXCEPTION 'idem: create_once: no unique index: % has no unique index on exactly (%), so a repeated create would not be stopped', tbl, array_to_string(cols, ', ')
            USING ERRCODE = 'IDR03',
                  DETAIL = no_arbiter,
                  HINT = format('CREATE UNIQUE INDEX ON %s (%s) (not partial, not deferrable)', tbl, array_to_string(cols, ', '));
    END IF;
    RETURN 0;
END
$$;

COMMENT ON FUNCTION idem_create_once_guard(regclass, text[]) IS
    'Folded into create_once''s INSERT when PostgreSQL plans it: 0 when ON CONFLICT (cols) finds a unique index on exactly cols in the catalog the INSERT is planned with, and the table has no deferrable unique or exclusion constraint, else SQLSTATE IDR03.';
