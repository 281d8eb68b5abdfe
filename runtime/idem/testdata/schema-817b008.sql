-- idemgen schema. Emitted verbatim by `idemgen schema` and applied by
-- runtime.Migrate; every statement is idempotent so either may run repeatedly.

-- idem_keys holds one row per completed Idempotency-Key. The claim row is
-- inserted in the same transaction as the handler's own writes, so a row that
-- other transactions can see is always a completed one; an in-flight claim is
-- visible only as the uncommitted unique-index entry that concurrent
-- duplicates block on (see README "In-flight requests").
CREATE TABLE IF NOT EXISTS idem_keys (
    scope        text        NOT NULL,
    principal    text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    status_code  integer     NOT NULL DEFAULT 0,
    headers      jsonb       NOT NULL DEFAULT '{}',
    body         bytea       NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, principal, key)
);

CREATE INDEX IF NOT EXISTS idem_keys_expires_at ON idem_keys (expires_at);

-- idem_processed_events records that a consumer context applied an event. The
-- row is inserted in the same transaction as the handler's writes, so "the
-- effect happened" and "the event is known" commit together; the broker
-- offset is committed only afterwards.
CREATE TABLE IF NOT EXISTS idem_processed_events (
    context      text        NOT NULL,
    event_id     text        NOT NULL,
    topic        text        NOT NULL,
    kpartition   integer     NOT NULL,
    koffset      bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (context, event_id)
);

CREATE INDEX IF NOT EXISTS idem_processed_events_processed_at ON idem_processed_events (processed_at);

-- idem_dead_letters keeps the records a consumer could not apply (undecodable,
-- or failing past the retry budget), raw, so nothing is silently dropped. One
-- row per (context, topic, partition, offset): a redelivery after a crash does
-- not duplicate it.
CREATE TABLE IF NOT EXISTS idem_dead_letters (
    id          bigserial   PRIMARY KEY,
    context     text        NOT NULL,
    topic       text        NOT NULL,
    kpartition  integer     NOT NULL,
    koffset     bigint      NOT NULL,
    record_key  bytea,
    value       bytea,
    headers     jsonb       NOT NULL DEFAULT '{}',
    attempts    integer     NOT NULL,
    last_error  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (context, topic, kpartition, koffset)
);

-- idem_outbox holds events written in business transactions until the relay
-- has published them: PENDING -> PUBLISHING (claimed by one relay, under a
-- claim token and a lease) -> PUBLISHED, or PARKED after too many failures.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           bigserial   PRIMARY KEY,
    event_id     text        NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
    topic        text        NOT NULL,
    record_key   bytea,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    status       text        NOT NULL DEFAULT 'PENDING'
                             CHECK (status IN ('PENDING', 'PUBLISHING', 'PUBLISHED', 'PARKED')),
    attempts     integer     NOT NULL DEFAULT 0,
    claim_token  text,
    locked_until timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    last_error   text
);

CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS idem_outbox_publishing ON idem_outbox (locked_until) WHERE status = 'PUBLISHING';
CREATE INDEX IF NOT EXISTS idem_outbox_published ON idem_outbox (published_at) WHERE status = 'PUBLISHED';

-- Wake the relay when an enqueueing transaction commits: NOTIFY is delivered
-- at commit, and never for a transaction that rolls back.
CREATE OR REPLACE FUNCTION idem_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER idem_outbox_notify
AFTER INSERT ON idem_outbox
FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_notify();
