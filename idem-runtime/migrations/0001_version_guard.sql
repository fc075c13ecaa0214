-- idem migration 0001: the version guard, the database-side backstop of
-- `#[derive(Versioned)]`.
--
-- Rust code that writes through `Model::update(..)` can only emit
-- `SET .., version = version + 1 WHERE .. AND version = $expected`. Everything
-- else that reaches the table (psql, a data fix, a bulk UPDATE written by hand,
-- another service) can forget the bump, and then a concurrent versioned writer
-- silently overwrites its change. A table that runs
-- `idem::versioned::backstop::install_version_guard::<Model>()` gets a
-- `BEFORE UPDATE FOR EACH ROW` trigger calling this function, which makes such
-- an UPDATE fail instead.
--
-- SQLSTATEs (class "ID" is not used by PostgreSQL, so retry logic that looks
-- at classes 40 or 55 never retries these; they are bugs, not races):
--   IDV01  the UPDATE does not set the version to exactly old version + 1
--   IDV02  the trigger itself is misconfigured (wrong argument, wrong event)
--
-- Keep this file byte-for-byte stable once released: its SHA-256 is recorded in
-- idem_schema_migrations, and an edited migration is refused, never re-applied.
-- Changes go into a new, higher-numbered migration.

CREATE OR REPLACE FUNCTION idem_version_guard() RETURNS trigger
LANGUAGE plpgsql
AS $idem_version_guard$
DECLARE
    version_column text;
    new_row jsonb;
    old_version bigint;
    new_version bigint;
BEGIN
    IF TG_WHEN <> 'BEFORE' OR TG_LEVEL <> 'ROW' OR TG_OP <> 'UPDATE' THEN
        RAISE EXCEPTION 'idem_version_guard on %.% must run BEFORE UPDATE FOR EACH ROW, not % % FOR EACH %',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), TG_WHEN, TG_OP, TG_LEVEL
            USING ERRCODE = 'IDV02';
    END IF;
    IF TG_NARGS <> 1 THEN
        RAISE EXCEPTION 'idem_version_guard on %.% takes exactly one argument, the name of the version column (got %)',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), TG_NARGS
            USING ERRCODE = 'IDV02';
    END IF;

    version_column := TG_ARGV[0];
    -- The column is named at run time, so read it through jsonb rather than
    -- dynamic SQL (which would be planned again on every row).
    new_row := to_jsonb(NEW);
    IF NOT new_row ? version_column THEN
        RAISE EXCEPTION 'idem_version_guard on %.%: the table has no column %; the trigger argument must name the version column',
                quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), quote_ident(version_column)
            USING ERRCODE = 'IDV02',
                  SCHEMA = TG_TABLE_SCHEMA,
                  TABLE = TG_TABLE_NAME;
    END IF;
    new_version := (new_row ->> version_column)::bigint;
    old_version := (to_jsonb(OLD) ->> version_column)::bigint;

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
END;
$idem_version_guard$;

COMMENT ON FUNCTION idem_version_guard() IS
    'idem backstop (migration 0001): BEFORE UPDATE FOR EACH ROW trigger function; TG_ARGV[0] names the version column. '
    'Rejects any UPDATE whose new version is not the old version + 1 with SQLSTATE IDV01 (IDV02: trigger misconfigured). '
    'Installed on a table by idem::versioned::backstop::install_version_guard as the trigger idem_version_guard.';
