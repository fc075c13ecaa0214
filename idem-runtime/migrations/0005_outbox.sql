-- The transactional outbox (idem_runtime::outbox): events written in the
-- business transaction, published afterwards by the relay, in order per key.

-- The last sequence number given to each key. Emitting bumps it with an
-- upsert, which holds the row lock until the emitting transaction ends: the
-- next emitter of the key waits, so sequence numbers follow commit order
-- and have no gaps.
CREATE TABLE idem_outbox_keys (
    key      text   PRIMARY KEY CHECK (octet_length(key) BETWEEN 1 AND 255),
    last_seq bigint NOT NULL CHECK (last_seq >= 1)
);

CREATE TABLE idem_outbox (
    id              uuid        PRIMARY KEY,
    key             text        NOT NULL CHECK (octet_length(key) BETWEEN 1 AND 255),
    seq             bigint      NOT NULL CHECK (seq >= 1),
    subject         text        NOT NULL CHECK (octet_length(subject) BETWEEN 1 AND 255),
    kind            text        NOT NULL,
    version         bigint      NOT NULL CHECK (version >= 0),
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    state           text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    last_error      text,
    sent_at         timestamptz,
    UNIQUE (key, seq),
    CHECK ((state = 'sent') = (sent_at IS NOT NULL))
);

-- The relay checks that nothing earlier of a key is unsent here.
CREATE INDEX idem_outbox_unsent ON idem_outbox (key, seq) WHERE state <> 'sent';
-- The relay's claim walks pending rows in the order they were written.
CREATE INDEX idem_outbox_pending ON idem_outbox (created_at, seq) WHERE state = 'pending';
-- The cleanup walks sent rows by age.
CREATE INDEX idem_outbox_sent ON idem_outbox (sent_at) WHERE state = 'sent';

-- Wakes relays that LISTEN idem_outbox when emitting transactions commit
-- (NOTIFY is delivered at commit, once per transaction for one payload).
CREATE FUNCTION idem_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER idem_outbox_notify AFTER INSERT ON idem_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_notify();

COMMENT ON TABLE idem_outbox_keys IS 'idem outbox: the last sequence number of each ordering key; its row lock orders emitters of one key by commit';
COMMENT ON COLUMN idem_outbox_keys.key IS 'the ordering key (the aggregate an event is about)';
COMMENT ON COLUMN idem_outbox_keys.last_seq IS 'the seq of the newest committed event of the key';
COMMENT ON TABLE idem_outbox IS 'idem outbox: one row per emitted event, written in the business transaction, published by the relay';
COMMENT ON COLUMN idem_outbox.id IS 'the event id, sent as Nats-Msg-Id: UUIDv5 of (scope, key, ordinal) inside an idempotent call, else UUIDv7';
COMMENT ON COLUMN idem_outbox.key IS 'the ordering key: events of one key are published in seq order, one at a time';
COMMENT ON COLUMN idem_outbox.seq IS 'position of the event in its key, 1, 2, .. in commit order without gaps';
COMMENT ON COLUMN idem_outbox.subject IS 'the subject the event is published on (after the publisher''s prefix)';
COMMENT ON COLUMN idem_outbox.kind IS 'the event type, Event::KIND';
COMMENT ON COLUMN idem_outbox.version IS 'the schema version of the payload, Event::VERSION';
COMMENT ON COLUMN idem_outbox.payload IS 'the event, serialized to JSON';
COMMENT ON COLUMN idem_outbox.created_at IS 'start of the emitting transaction';
COMMENT ON COLUMN idem_outbox.state IS 'pending (to publish), sent (acked by the broker), dead (publish failed max_attempts times; blocks its key until requeued)';
COMMENT ON COLUMN idem_outbox.attempts IS 'failed publish attempts so far';
COMMENT ON COLUMN idem_outbox.next_attempt_at IS 'after a failure: not retried before this (backoff)';
COMMENT ON COLUMN idem_outbox.lease_until IS 'a relay claimed the event until this time; after it another relay may publish it again';
COMMENT ON COLUMN idem_outbox.last_error IS 'what the last failed publish said';
COMMENT ON COLUMN idem_outbox.sent_at IS 'when the broker acked the event; sent rows are deleted after the retention';
COMMENT ON INDEX idem_outbox_unsent IS 'the relay checks here that no earlier event of a key is unsent (only a key''s head is claimed)';
COMMENT ON INDEX idem_outbox_pending IS 'the relay''s claim walks pending events in the order they were written';
COMMENT ON INDEX idem_outbox_sent IS 'the cleanup deletes sent events past the retention by this';
COMMENT ON FUNCTION idem_outbox_notify() IS 'NOTIFY idem_outbox on insert, so listening relays wake at commit';
COMMENT ON TRIGGER idem_outbox_notify ON idem_outbox IS 'wakes relays: one NOTIFY per inserting statement, delivered at commit';
