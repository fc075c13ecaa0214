-- idem migration 0014: idem_standby_holds(target), for pools built with
-- Replication::Synchronous.
--
-- A commit becomes visible on a primary before its synchronous standby holds
-- it when its wait for the standby is cancelled or its client goes away
-- (PostgreSQL then commits locally, with a WARNING). Such a record must not
-- be replayed before the standby holds it: a failover would erase what the
-- client was told. (The outbox relay needs no such wait: its claim is a
-- commit of its own, which returns only once the standby holds it.) This waits, on the
-- server, until every synchronous standby has flushed WAL up to `target`
-- (the caller passes pg_current_wal_flush_lsn(), at or past the commit of
-- anything it can see), and returns true. It waits as long as the statement
-- may run: the caller's statement_timeout (idem's deadline) ends it, and
-- with no synchronous standby connected it waits for one.
--
-- SECURITY DEFINER: the flush positions in pg_stat_replication are shown to
-- superusers and members of pg_read_all_stats only; the function runs with
-- the rights of the role that ran idem::migrate. If that role cannot see
-- them either, it says so (IDR02) instead of waiting for ever.
CREATE OR REPLACE FUNCTION idem_standby_holds(target pg_lsn) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog AS $$
DECLARE
    standbys int;
    hidden int;
    holding int;
    pause float8 := 0.001;
BEGIN
    LOOP
        -- Without the right to see them, a standby's state and positions
        -- read as NULL (with it, sync_state is never NULL; a flush position
        -- may be, for a sender still starting, which then holds nothing).
        SELECT count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')),
               count(*) FILTER (WHERE sync_state IS NULL),
               count(*) FILTER (WHERE sync_state IN ('sync', 'quorum') AND flush_lsn >= target)
          INTO standbys, hidden, holding
          FROM pg_stat_replication;
        IF hidden > 0 THEN
            RAISE EXCEPTION 'idem: the role that ran idem::migrate cannot read the standbys'' positions in pg_stat_replication'
                USING ERRCODE = 'IDR02',
                      HINT = 'GRANT pg_read_all_stats (or pg_monitor) to that role, or run idem::migrate as a superuser.';
        END IF;
        IF standbys > 0 AND holding = standbys THEN
            RETURN true;
        END IF;
        PERFORM pg_sleep(pause);
        pause := least(pause * 2, 0.02);
    END LOOP;
END
$$;

COMMENT ON FUNCTION idem_standby_holds(pg_lsn) IS
    'Waits until every synchronous standby has flushed WAL up to target (bounded by the caller''s statement_timeout); used by idem with Replication::Synchronous before a replay or a publish.';
