-- idemgen schema. Emitted verbatim by `idemgen schema` and applied by
-- runtime.Migrate; every statement is idempotent so either may run repeatedly.
--
-- Indexes and the trigger are created only after a catalog check (the DO
-- blocks), never with CREATE INDEX IF NOT EXISTS / CREATE OR REPLACE TRIGGER:
-- those lock the table even when the object exists, queueing behind every
-- request in flight and making new requests queue behind them, so applying
-- this file to a database that already has the objects (an upgrade from a
-- version without idem_schema_version, say) would stall running replicas.
-- Applied to existing tables, this file takes no lock a request conflicts with.

-- idem_keys holds one row per completed Idempotency-Key, written once, with
-- the response, in the same transaction as the handler's own writes
-- (StoreKey), so a row that other transactions can see is always a
-- completed one. A key in flight has no row: its marker is the claiming
-- transaction's advisory lock (see ClaimKey and README "In-flight
-- requests"). status_code's default is only for rows of older versions.
--
-- The key columns of idem_keys and idem_processed_events are COLLATE "C":
-- every claim, lookup and insert descends their primary keys, and under the
-- database's collation (anything but "C"/"POSIX", C.UTF-8 and en_US.UTF-8
-- included) each comparison is a strcoll() on copies of both strings, under
-- "C" a memcmp(). Only equality is ever asked of these columns (no query
-- sorts or ranges over them), and equality under a deterministic collation
-- is byte equality either way: the same rows match. A table created by an
-- earlier version keeps its columns' collation (CREATE TABLE IF NOT EXISTS
-- leaves it alone; changing it would rewrite the primary key under an ACCESS
-- EXCLUSIVE lock, which this file never takes): it works as before. See
-- README "Storage" for the optional manual change.
CREATE TABLE IF NOT EXISTS idem_keys (
    scope        text        COLLATE "C" NOT NULL,
    principal    text        COLLATE "C" NOT NULL,
    key          text        COLLATE "C" NOT NULL,
    fingerprint  bytea       NOT NULL,
    status_code  integer     NOT NULL DEFAULT 0,
    headers      jsonb       NOT NULL DEFAULT '{}',
    body         bytea       NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, principal, key)
);

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_keys'::regclass AND c.relname = 'idem_keys_expires_at') THEN
        CREATE INDEX idem_keys_expires_at ON idem_keys (expires_at);
    END IF;
END
$$;

-- idem_processed_events records that a consumer context applied an event. The
-- row is inserted in the same transaction as the handler's writes, so "the
-- effect happened" and "the event is known" commit together; the broker
-- offset is committed only afterwards.
CREATE TABLE IF NOT EXISTS idem_processed_events (
    context      text        COLLATE "C" NOT NULL,
    event_id     text        COLLATE "C" NOT NULL,
    topic        text        NOT NULL,
    kpartition   integer     NOT NULL,
    koffset      bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (context, event_id)
);

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_processed_events'::regclass AND c.relname = 'idem_processed_events_processed_at') THEN
        CREATE INDEX idem_processed_events_processed_at ON idem_processed_events (processed_at);
    END IF;
END
$$;

-- idem_dead_letters keeps the records a consumer could not apply (undecodable,
-- without an event id, or failing past the retry budget), raw, so nothing is
-- silently dropped. Everything that came from the broker is stored as bytes:
-- key, value, and the headers as two parallel arrays (repeated names kept, in
-- order), so no byte sequence can make the insert fail; last_error is
-- sanitized text. Rows are identified by id, never by (topic, partition,
-- offset): an offset can be reused (topic re-created, cluster restored) and a
-- new poison record must not collide with an old one. Only an exact
-- redelivery — same context, position and record_digest (a hash of key, value
-- and headers) — is stored once. replayed_at is set, in the same transaction
-- as the replay's effects, when an operator replays the dead letter.
CREATE TABLE IF NOT EXISTS idem_dead_letters (
    id             bigserial   PRIMARY KEY,
    context        text        NOT NULL,
    topic          text        NOT NULL,
    kpartition     integer     NOT NULL,
    koffset        bigint      NOT NULL,
    record_key     bytea,
    value          bytea,
    header_keys    bytea[]     NOT NULL DEFAULT '{}',
    header_values  bytea[]     NOT NULL DEFAULT '{}',
    record_digest  bytea       NOT NULL DEFAULT '',
    attempts       integer     NOT NULL,
    last_error     text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    replayed_at    timestamptz
);

-- Upgrade of a table created by an earlier version (headers jsonb, one row per
-- (context, topic, kpartition, koffset)). Each statement is a no-op on a
-- current table. The old jsonb headers are copied into the arrays before the
-- column is dropped (the old format had already lost repeated names and
-- non-UTF-8 bytes; what it kept is kept).
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS header_keys bytea[] NOT NULL DEFAULT '{}';
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS header_values bytea[] NOT NULL DEFAULT '{}';
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS record_digest bytea NOT NULL DEFAULT '';
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS replayed_at timestamptz;
ALTER TABLE idem_dead_letters DROP CONSTRAINT IF EXISTS idem_dead_letters_context_topic_kpartition_koffset_key;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_schema = current_schema() AND table_name = 'idem_dead_letters' AND column_name = 'headers') THEN
        EXECUTE $u$
            UPDATE idem_dead_letters d
            SET header_keys = h.ks, header_values = h.vs
            FROM (SELECT id,
                         array_agg(convert_to(e.key, 'UTF8') ORDER BY e.key) AS ks,
                         array_agg(convert_to(e.value, 'UTF8') ORDER BY e.key) AS vs
                  FROM idem_dead_letters, jsonb_each_text(headers) AS e
                  GROUP BY id) h
            WHERE d.id = h.id
        $u$;
        ALTER TABLE idem_dead_letters DROP COLUMN headers;
    END IF;
END;
$$;

CREATE UNIQUE INDEX IF NOT EXISTS idem_dead_letters_delivery
    ON idem_dead_letters (context, topic, kpartition, koffset, record_digest);

-- Retention (idem.Janitor) deletes the oldest dead letters first, through
-- this index rather than a scan of the table.
CREATE INDEX IF NOT EXISTS idem_dead_letters_created_at ON idem_dead_letters (created_at);

-- The idem.dead_letters gauge counts the dead letters still waiting for an
-- operator through this index.
CREATE INDEX IF NOT EXISTS idem_dead_letters_unreplayed ON idem_dead_letters (id) WHERE replayed_at IS NULL;

-- idem_key_completed_elsewhere fails the statement that calls it with a
-- serialization failure (40001): StoreKey found the key it claimed already
-- completed by another transaction, and the effect made under the claim
-- must not commit.
CREATE OR REPLACE FUNCTION idem_key_completed_elsewhere(scope text, principal text, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'idempotency key % (scope %) was completed by another transaction', key, scope
        USING ERRCODE = 'serialization_failure',
              HINT = 'The request is retried and replays the stored response.';
END
$$;

-- idem_uuid_v7 is a time-ordered UUID (RFC 9562 version 7: 48 bits of Unix
-- milliseconds, then random bits), the default outbox event id. Every claim
-- and mark UPDATE of an outbox row writes a new entry in the event_id unique
-- index (the status is in partial-index predicates, so the update is never
-- HOT): with random UUIDs those entries land all over an index of the whole
-- history, with time-ordered ones on its few rightmost pages.
CREATE OR REPLACE FUNCTION idem_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$$;

-- idem_outbox holds events written in business transactions until the relay
-- has published them: PENDING -> PUBLISHING (claimed by the leading relay,
-- under its lease token) -> PUBLISHED, or PARKED after a permanent error or
-- too many failures while other events got through. attempts counts only
-- failures charged to the row itself, never a broker-wide outage.
-- parked_at is when the row was last parked (the parking transaction's
-- now()), NULL unless status is PARKED: a requeue clears it. idemctl's
-- purge of parked rows goes by it, not by created_at (an event enqueued a
-- week ago and parked a minute ago is not a week-old parked row). A row
-- parked by a version without the column has none: its parking time is
-- unknown, and a purge by age keeps it.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           bigserial   PRIMARY KEY,
    event_id     text        NOT NULL UNIQUE DEFAULT idem_uuid_v7()::text,
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
    last_error   text,
    parked_at    timestamptz
);

-- An outbox created by a version without parked_at gets the column: nullable,
-- without a default, so adding it rewrites nothing (a catalog change under
-- a brief ACCESS EXCLUSIVE lock, bounded by Migrate's lock_timeout and
-- retried). Rows parked before the upgrade keep parked_at NULL (unknown).
-- After a catalog check, as for the indexes: ALTER TABLE locks the table
-- even when the column exists.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = 'idem_outbox'::regclass AND attname = 'parked_at' AND NOT attisdropped) THEN
        ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS parked_at timestamptz;
    END IF;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_outbox'::regclass AND c.relname = 'idem_outbox_pending') THEN
        CREATE INDEX idem_outbox_pending ON idem_outbox (id) WHERE status = 'PENDING';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_outbox'::regclass AND c.relname = 'idem_outbox_publishing') THEN
        CREATE INDEX idem_outbox_publishing ON idem_outbox (locked_until) WHERE status = 'PUBLISHING';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_outbox'::regclass AND c.relname = 'idem_outbox_published') THEN
        CREATE INDEX idem_outbox_published ON idem_outbox (published_at) WHERE status = 'PUBLISHED';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                   WHERE i.indrelid = 'idem_outbox'::regclass AND c.relname = 'idem_outbox_parked') THEN
        CREATE INDEX idem_outbox_parked ON idem_outbox (topic, id) WHERE status = 'PARKED';
    END IF;
END
$$;

-- idem_relay_leader is the relay's leadership lease: one row per outbox. The
-- leader renews expires_at (PostgreSQL's clock, never a replica's) every
-- third of the lease; a standby takes the row over once it has expired, with
-- a new token. Outbox rows are claimed and marked only under the current
-- token, so a leader that froze and woke up after losing the lease can
-- neither claim nor mark. A lease, not a session lock: a leader that is stuck
-- but still connected loses it all the same.
CREATE TABLE IF NOT EXISTS idem_relay_leader (
    name        text        PRIMARY KEY,
    holder      text        NOT NULL,
    token       text        NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

-- Wake the relay when an enqueueing transaction commits: NOTIFY is delivered
-- at commit, and never for a transaction that rolls back.
CREATE OR REPLACE FUNCTION idem_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem_outbox'::regclass AND tgname = 'idem_outbox_notify') THEN
        CREATE TRIGGER idem_outbox_notify AFTER INSERT ON idem_outbox
            FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_notify();
    END IF;
END
$$;

-- parked_at for a statement that does not know the column: a version older
-- than it (an old replica's relay during a rolling upgrade, or after a
-- rollback; an old idemctl's requeue) parks a row or requeues it without
-- touching parked_at. Unfixed, a row parked 10 days ago, requeued by an old
-- version (parked_at kept) and parked again a minute ago by an old relay
-- showed parked_at of 10 days ago, and purge --parked --older-than 7d
-- deleted it: its event lost. So an UPDATE that moves a row into PARKED, or
-- out of it with a parked_at, and leaves parked_at as it was gets the
-- parking time (now()) or loses it. This version's statements set
-- parked_at themselves (MarkOutboxFailed, the requeues), so the WHEN clause
-- (evaluated without calling the function) skips them, and the claims and
-- publishes that do not move a row into or out of PARKED.
CREATE OR REPLACE FUNCTION idem_outbox_parked_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.parked_at := CASE WHEN NEW.status = 'PARKED' THEN now() END;
    RETURN NEW;
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idem_outbox'::regclass AND tgname = 'idem_outbox_parked_at') THEN
        CREATE TRIGGER idem_outbox_parked_at BEFORE UPDATE ON idem_outbox
            FOR EACH ROW
            WHEN (NEW.status IS DISTINCT FROM OLD.status
                  AND NEW.parked_at IS NOT DISTINCT FROM OLD.parked_at
                  AND (NEW.status = 'PARKED' OR NEW.parked_at IS NOT NULL))
            EXECUTE FUNCTION idem_outbox_parked_at();
    END IF;
END
$$;

-- idem_schema_version records which text of this file was last applied (its
-- SHA-256, written by idem.Migrate after applying it), so that Migrate on a
-- current schema only reads this row: it then runs no DDL and takes no lock
-- that a running replica's requests could queue behind.
CREATE TABLE IF NOT EXISTS idem_schema_version (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    digest     text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- An outbox created before event ids were time-ordered gets the new default
-- (after a catalog check: ALTER TABLE locks the table, so only when needed).
DO $$
BEGIN
    IF (SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d
        JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
        WHERE d.adrelid = 'idem_outbox'::regclass AND a.attname = 'event_id') IS DISTINCT FROM '(idem_uuid_v7())::text' THEN
        ALTER TABLE idem_outbox ALTER COLUMN event_id SET DEFAULT idem_uuid_v7()::text;
    END IF;
END
$$;
