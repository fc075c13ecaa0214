-- idem migration 0018: the version guard reads only what idem and
-- PostgreSQL define, whatever the writing session's search_path, and a
-- tombstone only grows.
--
-- A trigger function runs as the role whose statement fired it, and
-- resolves unqualified names through that session's search_path. The
-- version guard of migration 0007 named to_jsonb, format and its other
-- functions, its operators and idem_version_tombstones unqualified, so a
-- role with no more than UPDATE or DELETE on a guarded table, and a schema
-- of its own (first on the default search_path, "$user", public), could
-- change what the guard checks:
--
-- 1. its own to_jsonb(<the table's row type>), an exact match, won over
--    pg_catalog.to_jsonb(anyelement) and reported the version it liked: an
--    UPDATE without the bump, or one that moved the row to another tenant,
--    was written;
-- 2. its own table idem_version_tombstones took the tombstone of the row it
--    deleted, so the row inserted again started at 0 and an old ETag
--    matched it.
--
-- (Its own operators, first on a search_path it sets, or a temporary table,
-- would do as much.) Now the guard calls pg_catalog's functions by their
-- qualified names, and it, idem_purge_version_tombstones and
-- idem_outbox_notify run with a search_path of their own: pg_catalog, the
-- schema that holds idem's tables (found here, where this migration runs),
-- and pg_temp last, so neither a role's schema nor its temporary tables
-- are looked at. Roles that may CREATE in the schema of idem's tables are
-- trusted as its owner is (PostgreSQL 15 lets none in public): an operator
-- there for types pg_catalog has none for exactly would serve the insert's
-- lock probe.
--
-- 3. A role that deletes rows of a guarded table needs INSERT and UPDATE on
--    idem_version_tombstones, and with them it could lower or move any
--    table's tombstones (UPDATE .. SET version = -1), so a row of a table it
--    has no right on started over. A trigger on idem_version_tombstones now
--    refuses an UPDATE that lowers a version or changes a tombstone's table
--    or identity (SQLSTATE IDV04); the guard's own upsert only raises it.
--    What such a role can still do to other tables' tombstones is raise
--    them, and read them.
--
-- Cost: a function-level search_path is set and reset at each call, about
-- 2 us per written row of a guarded table.
--
-- Keep this file byte-for-byte stable once released: its SHA-256 is recorded
-- in idem_schema_migrations. Changes go into a new, higher-numbered migration.

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
                pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), TG_WHEN, TG_OP, TG_LEVEL
            USING ERRCODE = 'IDV02';
    END IF;
    IF TG_NARGS < 1 OR (TG_NARGS = 1 AND TG_OP <> 'UPDATE') THEN
        RAISE EXCEPTION 'idem_version_guard on %.% (%) takes the name of the version column, then the names of the identity columns (tenant and key); with the version column alone it guards UPDATE only (got % arguments)',
                pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), TG_OP, TG_NARGS
            USING ERRCODE = 'IDV02';
    END IF;

    version_column := TG_ARGV[0];
    -- Columns are named at run time, so they are read through jsonb rather
    -- than dynamic SQL (which would be planned again on every row).
    IF TG_OP = 'DELETE' THEN
        new_row := pg_catalog.to_jsonb(OLD);
    ELSE
        new_row := pg_catalog.to_jsonb(NEW);
    END IF;
    IF NOT new_row ? version_column THEN
        RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger argument must name the version column',
                pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), pg_catalog.quote_ident(version_column)
            USING ERRCODE = 'IDV02',
                  SCHEMA = TG_TABLE_SCHEMA,
                  TABLE = TG_TABLE_NAME;
    END IF;

    IF TG_OP = 'UPDATE' THEN
        -- The common path: two jsonb lookups per identity column, nothing more.
        old_row := pg_catalog.to_jsonb(OLD);
        -- Identity first: no version bump makes this UPDATE acceptable.
        FOR i IN 1 .. TG_NARGS - 1 LOOP
            identity_column := TG_ARGV[i];
            IF new_row -> identity_column IS DISTINCT FROM old_row -> identity_column THEN
                RAISE EXCEPTION 'idem_version_guard: UPDATE moves a row of %.% by changing its identity column % from % to %; the key and tenant of a versioned row never change',
                        pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), pg_catalog.quote_ident(identity_column),
                        old_row -> identity_column, new_row -> identity_column
                    USING ERRCODE = 'IDV03',
                          SCHEMA = TG_TABLE_SCHEMA,
                          TABLE = TG_TABLE_NAME,
                          COLUMN = identity_column,
                          DETAIL = pg_catalog.format('old %s, new %s', old_row -> identity_column, new_row -> identity_column),
                          HINT = 'Insert a row with the new identity and delete the old one; a writer holding the old '
                                 'row''s version must not reach another row with it.';
            ELSIF new_row -> identity_column IS NULL THEN
                -- SQL NULL, not JSON null: the row has no such column.
                RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger arguments after the version column must name the identity columns',
                        pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), pg_catalog.quote_ident(identity_column)
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
                    pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), pg_catalog.quote_ident(version_column),
                    coalesce(old_version::text, 'NULL'), coalesce(new_version::text, 'NULL'),
                    coalesce((old_version + 1)::text, 'NULL')
                USING ERRCODE = 'IDV01',
                      SCHEMA = TG_TABLE_SCHEMA,
                      TABLE = TG_TABLE_NAME,
                      COLUMN = version_column,
                      DETAIL = pg_catalog.format('old version %s, new version %s',
                                      coalesce(old_version::text, 'NULL'), coalesce(new_version::text, 'NULL')),
                      HINT = pg_catalog.format('Write through idem''s Model::update(..), or add "%1$s = %1$s + 1" to the SET list '
                                    'and "AND %1$s = <the version you read>" to the WHERE clause.',
                                    pg_catalog.quote_ident(version_column));
        END IF;
        RETURN NEW;
    END IF;

    -- INSERT or DELETE: the identity as a jsonb object, the tombstone's key.
    FOR i IN 1 .. TG_NARGS - 1 LOOP
        identity_column := TG_ARGV[i];
        IF NOT new_row ? identity_column THEN
            RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger arguments after the version column must name the identity columns',
                    pg_catalog.quote_ident(TG_TABLE_SCHEMA), pg_catalog.quote_ident(TG_TABLE_NAME), pg_catalog.quote_ident(identity_column)
                USING ERRCODE = 'IDV02',
                      SCHEMA = TG_TABLE_SCHEMA,
                      TABLE = TG_TABLE_NAME;
        END IF;
        row_identity := row_identity || pg_catalog.jsonb_build_object(identity_column, new_row -> identity_column);
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
                 || pg_catalog.format('%I = ($1).%I', TG_ARGV[i], TG_ARGV[i]);
    END LOOP;
    EXECUTE pg_catalog.format('SELECT 1 FROM ONLY %I.%I WHERE %s FOR KEY SHARE', TG_TABLE_SCHEMA, TG_TABLE_NAME, probe)
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
            NEW := pg_catalog.jsonb_populate_record(NEW, pg_catalog.jsonb_build_object(version_column, last_version + 1));
        END IF;
    END IF;
    RETURN NEW;
END;
$idem_version_guard$;

DO $idem_0018$
DECLARE
    home text;
BEGIN
    SELECT n.nspname INTO STRICT home
    FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = 'idem_version_tombstones'::regclass;
    EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
                              'idem_version_guard()'::regprocedure, home);
    EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
                              'idem_purge_version_tombstones(interval)'::regprocedure, home);
    EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp',
                              'idem_outbox_notify()'::regprocedure);
END
$idem_0018$;

CREATE FUNCTION idem_version_tombstone_grows() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $idem_version_tombstone_grows$
BEGIN
    IF NEW.table_schema IS DISTINCT FROM OLD.table_schema
       OR NEW.table_name IS DISTINCT FROM OLD.table_name
       OR NEW.identity IS DISTINCT FROM OLD.identity THEN
        RAISE EXCEPTION 'idem: a tombstone''s table and identity never change (%.% % to %.% %)',
                OLD.table_schema, OLD.table_name, OLD.identity, NEW.table_schema, NEW.table_name, NEW.identity
            USING ERRCODE = 'IDV04',
                  HINT = 'Moving a tombstone lets the deleted row''s versions repeat.';
    END IF;
    IF NEW.version IS NULL OR NEW.version < OLD.version THEN
        RAISE EXCEPTION 'idem: the tombstone of %.% % only rises: version % to %',
                OLD.table_schema, OLD.table_name, OLD.identity, OLD.version, coalesce(NEW.version::text, 'NULL')
            USING ERRCODE = 'IDV04',
                  HINT = 'Lowering a tombstone lets the deleted row''s versions repeat; '
                         'purge old ones with idem_purge_version_tombstones(interval).';
    END IF;
    RETURN NEW;
END
$idem_version_tombstone_grows$;

CREATE TRIGGER idem_version_tombstone_grows BEFORE UPDATE ON idem_version_tombstones
    FOR EACH ROW EXECUTE FUNCTION idem_version_tombstone_grows();

COMMENT ON FUNCTION idem_version_tombstone_grows() IS
    'idem (migration 0018): refuses an UPDATE of idem_version_tombstones that lowers a version or changes a '
    'tombstone''s table or identity (SQLSTATE IDV04), so that a role granted UPDATE for the version guard''s '
    'upsert cannot make another table''s versions repeat.';
COMMENT ON TRIGGER idem_version_tombstone_grows ON idem_version_tombstones IS
    'a tombstone only grows: see idem_version_tombstone_grows()';

COMMENT ON FUNCTION idem_version_guard() IS
    'idem backstop (migrations 0001, 0007, 0018): BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW trigger function; '
    'TG_ARGV[0] names the version column, TG_ARGV[1..] the identity columns (tenant and key). '
    'Rejects any UPDATE whose new version is not the old version + 1 with SQLSTATE IDV01, and any UPDATE that changes '
    'an identity column with IDV03 (IDV02: trigger misconfigured). DELETE records the last version in '
    'idem_version_tombstones; INSERT of that identity starts above it. With TG_ARGV[0] alone: BEFORE UPDATE, IDV01 only. '
    'Runs with its own search_path (pg_catalog, the schema of idem_version_tombstones, pg_temp). '
    'Installed on a table by idem::versioned::backstop::install_version_guard as the trigger idem_version_guard.';
