-- idem migration 0007: the version guard also pins a row's identity, and a
-- version never repeats for the same identity.
--
-- Two holes of the guard of migration 0001, closed here:
--
-- 1. An UPDATE could move a row to another key or tenant, as long as it bumped
--    the version: a writer holding the old row's version then wrote to whatever
--    row took its place, and a tenant's row could be handed to another tenant.
--    The trigger now takes the identity columns (the tenant column and the key
--    columns) after the version column, and refuses an UPDATE that changes one
--    of them (SQLSTATE IDV03).
-- 2. DELETE and a later INSERT of the same identity restarted the version at 0,
--    so an old version (an ETag in a client's hands, `If-Match: "v3"`) matched
--    the new, different row once it reached that version again. The trigger now
--    also runs BEFORE DELETE, recording the deleted row's version in
--    idem_version_tombstones, and BEFORE INSERT, starting a row above the
--    version its identity last had.
--
-- The function keeps its name and its one-argument form (version column only,
-- BEFORE UPDATE only, exactly the behaviour of migration 0001), so triggers
-- installed before this migration keep working until installed again.
--
-- A concurrent DELETE and re-INSERT of one identity: the INSERT first locks
-- the row it is about to replace (SELECT .. FOR KEY SHARE), which waits for
-- an uncommitted DELETE of it; only then does it read the tombstone, so it
-- sees the tombstone that DELETE wrote. Under REPEATABLE READ or SERIALIZABLE
-- that lock raises 40001 (retryable) when the DELETE committed after the
-- inserting transaction took its snapshot. What is left: an old row inserted
-- AND deleted entirely after the snapshot of a REPEATABLE READ transaction
-- that then inserts the same identity.
--
-- Cost: UPDATE, the common path, only compares the identity columns of OLD
-- and NEW (jsonb lookups, no table access). DELETE upserts one tombstone.
-- INSERT runs one primary-key lookup on the table (dynamic SQL, planned per
-- row) and one on idem_version_tombstones. Tombstones stay until
-- idem_purge_version_tombstones removes them; their number is at most the
-- number of distinct identities ever deleted.
--
-- SQLSTATEs, in addition to those of migration 0001 (IDV01 no bump, IDV02
-- misconfigured):
--   IDV03  the UPDATE changes an identity column (key or tenant)
--
-- Keep this file byte-for-byte stable once released: its SHA-256 is recorded in
-- idem_schema_migrations. Changes go into a new, higher-numbered migration.

-- COLLATE "C": the trigger compares them with TG_TABLE_SCHEMA and TG_TABLE_NAME,
-- which are of type name (collation "C"); under another collation the primary
-- key would not serve that lookup.
CREATE TABLE idem_version_tombstones (
    table_schema text COLLATE "C" NOT NULL,
    table_name   text COLLATE "C" NOT NULL,
    identity     jsonb          NOT NULL,
    version      bigint         NOT NULL,
    deleted_at   timestamptz    NOT NULL DEFAULT now(),
    PRIMARY KEY (table_schema, table_name, identity)
);

-- The purge walks tombstones by age.
CREATE INDEX idem_version_tombstones_deleted_at ON idem_version_tombstones (deleted_at);

COMMENT ON TABLE idem_version_tombstones IS
    'idem (migration 0007): the last version of every deleted row of a table guarded by idem_version_guard, '
    'so that a row inserted again with the same identity starts above it and an old version (ETag) never matches it. '
    'Written by the trigger on DELETE, read on INSERT; idem_purge_version_tombstones(interval) removes old ones.';
COMMENT ON COLUMN idem_version_tombstones.table_schema IS 'schema of the guarded table (TG_TABLE_SCHEMA; for a partitioned table, of the partition)';
COMMENT ON COLUMN idem_version_tombstones.table_name IS 'name of the guarded table (TG_TABLE_NAME; for a partitioned table, the partition)';
COMMENT ON COLUMN idem_version_tombstones.identity IS 'the deleted row''s identity columns (trigger arguments after the version column) as a jsonb object {column: value}';
COMMENT ON COLUMN idem_version_tombstones.version IS 'the highest version a deleted row of this identity had; an INSERT of the identity starts at version + 1 or above';
COMMENT ON COLUMN idem_version_tombstones.deleted_at IS 'start of the transaction of the latest DELETE of this identity; the purge goes by it';

CREATE OR REPLACE FUNCTION idem_version_guard() RETURNS trigger
LANGUAGE plpgsql
AS $idem_version_guard$
DECLARE
    version_column text;
    identity_column text;
    new_row jsonb;
    old_row jsonb;
    old_version bigint;
    new_version bigint;
    row_identity jsonb := '{}';
    probe text := '';
    last_version bigint;
BEGIN
    IF TG_WHEN <> 'BEFORE' OR TG_LEVEL <> 'ROW' THEN
        RAISE EXCEPTION 'idem_version_guard on %.% must run BEFORE .. FOR EACH ROW, not % % FOR EACH %',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), TG_WHEN, TG_OP, TG_LEVEL
            USING ERRCODE = 'IDV02';
    END IF;
    IF TG_NARGS < 1 OR (TG_NARGS = 1 AND TG_OP <> 'UPDATE') THEN
        RAISE EXCEPTION 'idem_version_guard on %.% (%) takes the name of the version column, then the names of the identity columns (tenant and key); with the version column alone it guards UPDATE only (got % arguments)',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), TG_OP, TG_NARGS
            USING ERRCODE = 'IDV02';
    END IF;

    version_column := TG_ARGV[0];
    -- Columns are named at run time, so they are read through jsonb rather
    -- than dynamic SQL (which would be planned again on every row).
    IF TG_OP = 'DELETE' THEN
        new_row := to_jsonb(OLD);
    ELSE
        new_row := to_jsonb(NEW);
    END IF;
    IF NOT new_row ? version_column THEN
        RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger argument must name the version column',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(version_column)
            USING ERRCODE = 'IDV02',
                  SCHEMA = TG_TABLE_SCHEMA,
                  TABLE = TG_TABLE_NAME;
    END IF;

    IF TG_OP = 'UPDATE' THEN
        -- The common path: two jsonb lookups per identity column, nothing more.
        old_row := to_jsonb(OLD);
        -- Identity first: no version bump makes this UPDATE acceptable.
        FOR i IN 1 .. TG_NARGS - 1 LOOP
            identity_column := TG_ARGV[i];
            IF new_row -> identity_column IS DISTINCT FROM old_row -> identity_column THEN
                RAISE EXCEPTION 'idem_version_guard: UPDATE moves a row of %.% by changing its identity column % from % to %; the key and tenant of a versioned row never change',
                        quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(identity_column),
                        old_row -> identity_column, new_row -> identity_column
                    USING ERRCODE = 'IDV03',
                          SCHEMA = TG_TABLE_SCHEMA,
                          TABLE = TG_TABLE_NAME,
                          COLUMN = identity_column,
                          DETAIL = format('old %s, new %s', old_row -> identity_column, new_row -> identity_column),
                          HINT = 'Insert a row with the new identity and delete the old one; a writer holding the old '
                                 'row''s version must not reach another row with it.';
            ELSIF new_row -> identity_column IS NULL THEN
                -- SQL NULL, not JSON null: the row has no such column.
                RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger arguments after the version column must name the identity columns',
                        quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(identity_column)
                    USING ERRCODE = 'IDV02',
                          SCHEMA = TG_TABLE_SCHEMA,
                          TABLE = TG_TABLE_NAME;
            END IF;
        END LOOP;

        new_version := (new_row ->> version_column)::bigint;
        old_version := (old_row ->> version_column)::bigint;
        -- NULL-safe: a NULL on either side is refused as well.
        IF new_version IS NULL OR old_version IS NULL OR new_version <> old_version + 1 THEN
            RAISE EXCEPTION 'idem_version_guard: UPDATE of %.% changes % from % to %; every UPDATE must set it to exactly % (old version + 1)',
                    quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(version_column),
                    coalesce(old_version::text, 'NULL'), coalesce(new_version::text, 'NULL'),
                    coalesce((old_version + 1)::text, 'NULL')
                USING ERRCODE = 'IDV01',
                      SCHEMA = TG_TABLE_SCHEMA,
                      TABLE = TG_TABLE_NAME,
                      COLUMN = version_column,
                      DETAIL = format('old version %s, new version %s',
                                      coalesce(old_version::text, 'NULL'), coalesce(new_version::text, 'NULL')),
                      HINT = format('Write through idem''s Model::update(..), or add "%1$s = %1$s + 1" to the SET list '
                                    'and "AND %1$s = <the version you read>" to the WHERE clause.',
                                    quote_ident(version_column));
        END IF;
        RETURN NEW;
    END IF;

    -- INSERT or DELETE: the identity as a jsonb object, the tombstone's key.
    FOR i IN 1 .. TG_NARGS - 1 LOOP
        identity_column := TG_ARGV[i];
        IF NOT new_row ? identity_column THEN
            RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger arguments after the version column must name the identity columns',
                    quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(identity_column)
                USING ERRCODE = 'IDV02',
                      SCHEMA = TG_TABLE_SCHEMA,
                      TABLE = TG_TABLE_NAME;
        END IF;
        row_identity := row_identity || jsonb_build_object(identity_column, new_row -> identity_column);
    END LOOP;

    IF TG_OP = 'DELETE' THEN
        old_version := (new_row ->> version_column)::bigint;
        IF old_version IS NOT NULL THEN
            INSERT INTO idem_version_tombstones AS t (table_schema, table_name, identity, version)
            VALUES (TG_TABLE_SCHEMA::text, TG_TABLE_NAME::text, row_identity, old_version)
            ON CONFLICT (table_schema, table_name, identity) DO UPDATE
                SET version = greatest(t.version, EXCLUDED.version),
                    deleted_at = EXCLUDED.deleted_at;
        END IF;
        RETURN OLD;
    END IF;

    -- INSERT. Wait for a concurrent DELETE of this identity before reading its
    -- tombstone (see the header): lock the row this one replaces, if any.
    FOR i IN 1 .. TG_NARGS - 1 LOOP
        probe := probe || CASE WHEN i > 1 THEN ' AND ' ELSE '' END
                 || format('%I = ($1).%I', TG_ARGV[i], TG_ARGV[i]);
    END LOOP;
    EXECUTE format('SELECT 1 FROM ONLY %I.%I WHERE %s FOR KEY SHARE', TG_TABLE_SCHEMA, TG_TABLE_NAME, probe)
        USING NEW;

    SELECT t.version INTO last_version
    FROM idem_version_tombstones t
    -- As text, in the columns' collation "C": compared as name, or in another
    -- collation, the primary key goes unused and every INSERT scans the table.
    WHERE t.table_schema = TG_TABLE_SCHEMA::text AND t.table_name = TG_TABLE_NAME::text
      AND t.identity = row_identity;
    IF FOUND THEN
        new_version := (new_row ->> version_column)::bigint;
        IF new_version IS NULL OR new_version <= last_version THEN
            NEW := jsonb_populate_record(NEW, jsonb_build_object(version_column, last_version + 1));
        END IF;
    END IF;
    RETURN NEW;
END;
$idem_version_guard$;

COMMENT ON FUNCTION idem_version_guard() IS
    'idem backstop (migrations 0001, 0007): BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW trigger function; '
    'TG_ARGV[0] names the version column, TG_ARGV[1..] the identity columns (tenant and key). '
    'Rejects any UPDATE whose new version is not the old version + 1 with SQLSTATE IDV01, and any UPDATE that changes '
    'an identity column with IDV03 (IDV02: trigger misconfigured). DELETE records the last version in '
    'idem_version_tombstones; INSERT of that identity starts above it. With TG_ARGV[0] alone: BEFORE UPDATE, IDV01 only. '
    'Installed on a table by idem::versioned::backstop::install_version_guard as the trigger idem_version_guard.';

CREATE FUNCTION idem_purge_version_tombstones(older_than interval) RETURNS bigint
LANGUAGE sql
AS $idem_purge_version_tombstones$
    WITH purged AS (
        -- least(): now() minus a longer interval is out of the timestamp
        -- range, and nothing is older than 1000 years anyway.
        DELETE FROM idem_version_tombstones
        WHERE deleted_at < now() - least(older_than, interval '1000 years')
        RETURNING 1
    )
    SELECT count(*) FROM purged;
$idem_purge_version_tombstones$;

COMMENT ON FUNCTION idem_purge_version_tombstones(interval) IS
    'idem (migration 0007): deletes the tombstones of identities deleted longer than older_than ago and returns how many. '
    'A row inserted again with a purged identity starts at the version it is inserted with (0 through idem), so choose '
    'older_than longer than any client keeps a version (ETag) it read.';
