-- A collapsed enqueue owes a run that starts after its decision committed
-- (idem_runtime::jobs). The enqueue counts itself on the job's row, a row
-- lock that no claim passes while the deciding transaction is open. A run
-- holds the row with FOR KEY SHARE, which such an enqueue does not wait
-- for, reads the count when it starts and, at its end, locks the row (so it
-- waits for a deciding transaction still open on it): if the count moved,
-- the job is made due again instead of being deleted.
--
-- The run count is each run's token and now never goes back (two runs of
-- one job hold the row side by side, so their tokens must differ):
-- a requeue, or a new run owed to a collapsed enqueue, starts the ladder
-- anew from ladder_from instead of resetting attempts.
ALTER TABLE idem_jobs
    ADD COLUMN collapsed   bigint  NOT NULL DEFAULT 0 CHECK (collapsed >= 0),
    ADD COLUMN ladder_from integer NOT NULL DEFAULT 0 CHECK (ladder_from >= 0);

COMMENT ON COLUMN idem_jobs.collapsed IS 'enqueues collapsed into this job so far; a run that ends seeing more than it started with leaves the job due again (a new decision committed while it ran)';
COMMENT ON COLUMN idem_jobs.ladder_from IS 'attempts when the ladder last started afresh (a requeue, or a run owed to a collapsed enqueue); the ladder counts attempts - ladder_from failures';
COMMENT ON COLUMN idem_jobs.attempts IS 'runs started so far (claims), never reset: the claim bumps it, and a run completes or fails only while it is still the job''s newest';
