-- The consumer-side inbox: one row per message a consumer has settled.
-- A row in state 'done' commits in the same transaction as the message's
-- effect, so "effect applied" and "message recorded" are one fact; a row in
-- state 'dead' is a message parked after too many failed deliveries.
CREATE TABLE idem_inbox (
    consumer    text        NOT NULL CHECK (octet_length(consumer) BETWEEN 1 AND 255),
    msg_id      text        NOT NULL CHECK (octet_length(msg_id) BETWEEN 1 AND 255),
    state       text        NOT NULL CHECK (state IN ('done', 'dead')),
    deliveries  bigint      NOT NULL CHECK (deliveries >= 1),
    last_error  text,
    payload     bytea,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, msg_id),
    -- A dead letter keeps why it died and what to run again; a done record
    -- keeps neither (the payload is the producer's, not ours to hoard).
    CHECK ((state = 'dead') = (last_error IS NOT NULL AND payload IS NOT NULL))
);

-- The purge walks a consumer's done records by age; dead letters wait for a
-- person and are never purged by age.
CREATE INDEX idem_inbox_done_age ON idem_inbox (consumer, updated_at) WHERE state = 'done';

COMMENT ON TABLE idem_inbox IS 'idem: one record per message a consumer has settled; the primary key is the arbiter of who applies a message';
COMMENT ON COLUMN idem_inbox.consumer IS 'the consumer (its durable name): the key space of message ids';
COMMENT ON COLUMN idem_inbox.msg_id IS 'the message id: the Nats-Msg-Id header, else the stream sequence';
COMMENT ON COLUMN idem_inbox.state IS 'done: the effect committed with this row; dead: parked after too many failed deliveries';
COMMENT ON COLUMN idem_inbox.deliveries IS 'the delivery count when the message was settled';
COMMENT ON COLUMN idem_inbox.last_error IS 'dead: the last error of the effect';
COMMENT ON COLUMN idem_inbox.payload IS 'dead: the message body, run again by a requeue';
COMMENT ON COLUMN idem_inbox.created_at IS 'when the message was first settled';
COMMENT ON COLUMN idem_inbox.updated_at IS 'when the record last changed state (the purge counts age from here)';
