-- The delayed compensation queue (idem_runtime::jobs): a job is written in
-- the transaction that decides to compensate, run later by a worker under
-- the retry loop, and deleted in the same transaction as its handler's
-- effect. A failed run waits for the next step of the worker's ladder; past
-- the last step the job is parked as dead until requeued.
CREATE TABLE idem_jobs (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text        NOT NULL CHECK (octet_length(kind) BETWEEN 1 AND 255),
    key          text        NOT NULL CHECK (octet_length(key) BETWEEN 1 AND 255),
    payload      jsonb       NOT NULL,
    state        text        NOT NULL DEFAULT 'due' CHECK (state IN ('due', 'running', 'dead')),
    attempts     integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    run_at       timestamptz NOT NULL DEFAULT now(),
    locked_until timestamptz,
    locked_by    text,
    last_error   text,
    failed_at    timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    -- A lease exists exactly while a worker holds the job.
    CHECK ((state = 'running') = (locked_until IS NOT NULL)),
    -- A dead job always says why.
    CHECK (state <> 'dead' OR (last_error IS NOT NULL AND failed_at IS NOT NULL))
);

-- At most one unfinished job per (kind, key): a second enqueue while one is
-- due or running collapses into it. Dead jobs leave the index, so deciding
-- to compensate again after a job died starts a fresh one.
CREATE UNIQUE INDEX idem_jobs_unfinished ON idem_jobs (kind, key) WHERE state <> 'dead';
-- The claim walks due jobs by due time ...
CREATE INDEX idem_jobs_due ON idem_jobs (run_at) WHERE state = 'due';
-- ... and running jobs whose lease ran out (their worker died).
CREATE INDEX idem_jobs_leased ON idem_jobs (locked_until) WHERE state = 'running';
-- Operators list dead jobs, oldest failure first.
CREATE INDEX idem_jobs_dead ON idem_jobs (failed_at) WHERE state = 'dead';

COMMENT ON TABLE idem_jobs IS 'idem jobs: delayed compensation jobs, enqueued in the deciding transaction, deleted in the transaction of their handler''s effect';
COMMENT ON COLUMN idem_jobs.id IS 'the job id (JobId)';
COMMENT ON COLUMN idem_jobs.kind IS 'the job type, Job::KIND; a worker claims only the kinds it has handlers for';
COMMENT ON COLUMN idem_jobs.key IS 'what the job is about, Job::key(); one unfinished job per (kind, key)';
COMMENT ON COLUMN idem_jobs.payload IS 'the job, serialized to JSON; the first enqueue''s payload wins when later ones collapse into it';
COMMENT ON COLUMN idem_jobs.state IS 'due (waiting for run_at), running (leased by a worker until locked_until), dead (failed past the last step of the ladder; waits for a requeue)';
COMMENT ON COLUMN idem_jobs.attempts IS 'runs started so far (claims); the claim bumps it, and a run completes or fails only while it is still the job''s newest';
COMMENT ON COLUMN idem_jobs.run_at IS 'due: not run before this database time (enqueue delay, or the ladder step after a failure)';
COMMENT ON COLUMN idem_jobs.locked_until IS 'running: the lease; after it another worker may run the job again (its worker died)';
COMMENT ON COLUMN idem_jobs.locked_by IS 'running: the name of the worker holding the lease, for operators';
COMMENT ON COLUMN idem_jobs.last_error IS 'what the last failed run said (kept after a requeue)';
COMMENT ON COLUMN idem_jobs.failed_at IS 'database time of the last failure; run_at - failed_at is the ladder step waited';
COMMENT ON COLUMN idem_jobs.created_at IS 'start of the enqueuing transaction';
COMMENT ON COLUMN idem_jobs.updated_at IS 'when the row last changed state';
COMMENT ON INDEX idem_jobs_unfinished IS 'one due or running job per (kind, key): a duplicate enqueue collapses into it';
COMMENT ON INDEX idem_jobs_due IS 'the claim finds due jobs by due time here';
COMMENT ON INDEX idem_jobs_leased IS 'the claim finds running jobs whose lease ran out here';
COMMENT ON INDEX idem_jobs_dead IS 'dead jobs, for operators and requeue';
