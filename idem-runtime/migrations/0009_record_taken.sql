-- idem migration 0009: a local request's completed record raises an error,
-- rather than writing nothing, when a live record of its key is already there.
--
-- Local mode writes its record in the statement sent with COMMIT, in one
-- round trip. A statement that wrote nothing would let that COMMIT commit
-- the body's writes without their record. So where the record's INSERT used
-- to write no row (a live record of the key appeared after the request read
-- it: an external-mode claim, which does not queue on local mode's advisory
-- lock), it now raises IDR01. The transaction is aborted, the COMMIT behind
-- it rolls it back, and the request reads the record again. The error is
-- idem's own and never reaches callers.
CREATE OR REPLACE FUNCTION idem_record_taken() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'idem: record taken: a live idempotency record of this key appeared after the request read it'
        USING ERRCODE = 'IDR01',
              HINT = 'idem rolls the request back and reads the record; this is not an application error.';
END
$$;

COMMENT ON FUNCTION idem_record_taken() IS
    'Raised by the INSERT of a local request''s completed record instead of writing nothing (SQLSTATE IDR01), so that the COMMIT pipelined behind it rolls back.';
