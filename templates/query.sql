-- name: SetLockTimeout :exec
-- Bounds how long a claim waits for a concurrent in-flight duplicate. The
-- previous value is kept in idem.saved_lock_timeout so RestoreLockTimeout can
-- put it back: the wait bound must not leak into the handler's own queries.
SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true),
       set_config('lock_timeout', @lock_timeout::text, true);

-- name: SetConnectionCheck :exec
-- Makes the backend check, during long statements and lock waits too, that
-- the client is still connected, so a killed process frees its keys within
-- the interval instead of when the statement ends. Transaction-scoped.
SELECT set_config('client_connection_check_interval', @interval::text, true);

-- name: SetIdleInTransactionTimeout :exec
-- Ends the session of a process that stops (SIGSTOP, a VM pause, a stuck
-- runtime) in the middle of a transaction: its connection stays open, so
-- neither a kill check nor TCP keepalives notice it, and its locks (an
-- in-flight key, a processed-event row) would be held until it woke up.
-- Transaction-scoped.
SELECT set_config('idle_in_transaction_session_timeout', @timeout::text, true);

-- name: SessionIdleInTransactionTimeout :one
-- The session's idle_in_transaction_session_timeout in milliseconds (0:
-- off), read when a session ended with 25P03 and the runtime did not set
-- the timeout itself (it was left to the server's or the role's setting):
-- whether the function that ran before it idled at least that long decides
-- whose failure it was.
SELECT (extract(epoch FROM current_setting('idle_in_transaction_session_timeout')::interval) * 1000)::bigint AS ms;

-- name: RestoreLockTimeout :exec
SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true);

-- name: RestoreLockTimeoutSnapshot :one
-- RestoreLockTimeout for a claim in a transaction begun with no isolation
-- level (TxOptions{}), whose level is then the session's
-- default_transaction_isolation: a server, a database or a role may make
-- it repeatable read or serializable. snapshot reports that the
-- transaction reads from a snapshot taken at its first statement, older
-- than the claim's lock, so the claim checks the unique index before the
-- function runs (ClaimKeyRow, in one more round trip, sent only then).
-- Two columns, not one expression: AND may skip set_config.
SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS lock_timeout,
       current_setting('transaction_isolation') IN ('repeatable read', 'serializable') AS snapshot;

-- name: SetTxSettings :exec
-- The transaction's settings in one statement, sent with BEGIN (see
-- SetLockTimeout, SetConnectionCheck and SetIdleInTransactionTimeout for
-- what each is for). An empty value leaves that setting as the session has
-- it; CASE keeps an unset one from being touched at all, so a server that
-- does not know client_connection_check_interval only refuses it when asked
-- to set it. The session's lock_timeout is kept in idem.saved_lock_timeout
-- for RestoreLockTimeout. idem.session keeps the session's settings that
-- the statement before the COMMIT puts back (search_path, the transaction
-- defaults, statement_timeout, synchronous_commit, session_replication_role,
-- role: what a function's SET, SET LOCAL or set_config changed must not
-- outlive its transaction on the pooled connection, see StoreKey), and
-- idem.keys_rel the idem_keys table the claim reads, which StoreKey checks.
SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true),
       set_config('idem.session', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')), true),
       set_config('idem.keys_rel', 'idem_keys'::regclass::oid::text, true),
       CASE WHEN @lock_timeout::text <> '' THEN set_config('lock_timeout', @lock_timeout::text, true) END,
       CASE WHEN @conn_check::text <> '' THEN set_config('client_connection_check_interval', @conn_check::text, true) END,
       CASE WHEN @idle::text <> '' THEN set_config('idle_in_transaction_session_timeout', @idle::text, true) END;

-- name: ClaimKey :one
-- Claims (scope, principal, key) for this transaction unless the key has a
-- live row: the transaction-scoped advisory lock on @lock_id (a 64-bit hash
-- of the key, see idem.Key) is the in-flight marker, and only its holder
-- runs the key and writes its row (StoreKey, at completion: the row is
-- written once, with the response). A key with a live row (the common
-- replay) is left alone: no advisory lock, no row lock, no transaction id,
-- no WAL, so a replay is a read and replays of one key never serialise. CASE
-- fixes the order: the lock is tried only when no live row is seen (the
-- planner may reorder AND). It returns false when the lock is held elsewhere
-- (the key is in flight) or a live row exists; true when this transaction
-- now holds the key, which GetKey, run next with a fresh snapshot, confirms:
-- a row committed between this statement's snapshot and the lock is seen
-- there (under read committed). Advisory locks are per database, not per
-- schema: the lock id is XORed with this idem_keys table's OID, so the same
-- key in flight in another schema's table (another tenant's or test's
-- schema) is not taken for this one's.
SELECT CASE WHEN EXISTS (SELECT 1 FROM idem_keys k
                         WHERE k.scope = @scope AND k.principal = @principal AND k.key = @key AND k.expires_at > now())
            THEN false
            ELSE pg_try_advisory_xact_lock(@lock_id::bigint # 'idem_keys'::regclass::oid::bigint) END::boolean AS claimed;

-- name: LockExpiredKey :exec
-- Locks the key's row when it has expired and this transaction holds the
-- key's advisory lock (taken by ClaimKey; trying it again is a no-op for its
-- holder): the row is taken over, and StoreKey replaces it at completion
-- without waiting. It is sent only after a claim whose GetKey saw an expired
-- row (the rare reuse of a key after its TTL), in a round trip of its own
-- before the function runs, between SetLockTimeout and RestoreLockTimeout:
-- the common claim locks no row (a FOR UPDATE costs the backend CPU even
-- when there is no row). Any wait is here, on a row lock held by something
-- else (a purge deleting the expired row), bounded by what is left of the
-- claim's lock_timeout; a purge that deleted the row leaves nothing to lock,
-- and StoreKey inserts. A live row is only read (the CASE tries the lock for
-- an expired row only, and a row that fails the WHERE is not locked).
SELECT 1 FROM idem_keys
WHERE scope = @scope AND principal = @principal AND key = @key
  AND CASE WHEN expires_at <= now() THEN pg_try_advisory_xact_lock(@lock_id::bigint # 'idem_keys'::regclass::oid::bigint) ELSE false END
FOR UPDATE;

-- name: GetKey :one
-- live is false for an expired row: after its TTL a key counts as new.
SELECT fingerprint, status_code, headers, body, expires_at, (expires_at > now())::boolean AS live
FROM idem_keys
WHERE scope = @scope AND principal = @principal AND key = @key;

-- name: ClaimKeyRow :exec
-- Sent only when the transaction's snapshot is older than the claim's lock
-- (repeatable read, serializable, or a custom BEGIN the runtime cannot
-- read), after GetKey: with the claim when TxOptions name the level, in a
-- round trip of its own after it when the level is the session's default
-- (RestoreLockTimeoutSnapshot). A row committed between that snapshot and the lock
-- is invisible to ClaimKey and GetKey, which then see a free key; this
-- INSERT finds it through the unique index and fails with a serialization
-- failure (40001) before the function runs, so the function never runs a
-- second time for a completed key. When there is no such row it writes a
-- claim row visible only to this transaction (already expired, so StoreKey
-- replaces it). Under read committed GetKey's fresh snapshot sees the row,
-- and nothing is written before completion.
INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at)
SELECT @scope, @principal, @key, '\x'::bytea, now()
WHERE CASE WHEN EXISTS (SELECT 1 FROM idem_keys k
                        WHERE k.scope = @scope AND k.principal = @principal AND k.key = @key AND k.expires_at > now())
           THEN false
           ELSE pg_try_advisory_xact_lock(@lock_id::bigint # 'idem_keys'::regclass::oid::bigint) END
ON CONFLICT (scope, principal, key) DO NOTHING;

-- name: StoreKey :exec
-- Stores the response of the key this transaction claimed, in the
-- transaction that made the effect: a new row, or an expired one taken
-- over (or this transaction's own claim row, ClaimKeyRow's). A claim that
-- saw no row and wrote none stores with StoreNewKey instead. A live row here means another transaction completed the key
-- without the advisory lock (under repeatable read that is a row committed
-- after this transaction's snapshot, which PostgreSQL itself reports as a
-- serialization failure): idem_key_completed_elsewhere raises 40001 then,
-- so the COMMIT pipelined after this statement is skipped and the effect
-- rolls back; the retry replays the row. The TTL counts from this
-- statement, the completion, not from the transaction's start (the claim):
-- a function slower than its TTL still leaves a key that replays for the
-- whole TTL. The headers are sent as text: a
-- []byte parameter would be sent as a bytea literal by a pool that does not
-- describe statements (QueryExecModeExec, QueryExecModeSimpleProtocol),
-- which jsonb refuses. The first WHEN checks that this is still the
-- transaction that claimed the key: the claim's settings set
-- idem.saved_lock_timeout for the transaction (SetTxSettings or
-- SetLockTimeout), and a function that ended it and chained another one
-- (COMMIT AND CHAIN, ROLLBACK AND CHAIN, ROLLBACK; BEGIN) has released the
-- key's lock and left its work committed or rolled back elsewhere: the
-- statement fails (22P02, with a message the runtime recognises), which
-- undoes its INSERT too: nothing is stored and the COMMIT is skipped.
-- The second WHEN fails it the same way when idem_keys, as this statement
-- was planned, is not the table the claim read (idem.keys_rel): the
-- function changed search_path (SET, SET LOCAL, set_config) or made a
-- temporary idem_keys, and the key would be stored where the next claim
-- does not look. The third puts back the session settings saved in
-- idem.session (SetTxSettings) that the function changed, at session level,
-- so that none outlives the transaction (a CASE that is never true: only
-- its evaluation matters); the fourth fails when a temporary table has the
-- name of one of the runtime's tables (it would hide that table from every
-- later statement on the connection; the rollback drops it).
WITH stored AS (
    INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
    VALUES (@scope, @principal, @key, @fingerprint, @status_code, CAST(sqlc.arg(headers)::text AS jsonb), @body,
            statement_timestamp() + make_interval(secs => @ttl_seconds::float8))
    ON CONFLICT (scope, principal, key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status_code = excluded.status_code, headers = excluded.headers,
        body = excluded.body, created_at = excluded.created_at, expires_at = excluded.expires_at
    WHERE idem_keys.expires_at <= now()
    RETURNING 1
)
SELECT CASE WHEN coalesce(current_setting('idem.saved_lock_timeout', true), '') = ''
            THEN CAST(coalesce(current_setting('idem.saved_lock_timeout', true), '') || 'idem: not the transaction that claimed the key' AS boolean)
            WHEN coalesce(current_setting('idem.keys_rel', true), '') NOT IN ('', 'idem_keys'::regclass::oid::text)
            THEN CAST(coalesce(current_setting('idem.keys_rel', true), '') || 'idem: the function made idem_keys name another table' AS boolean)
            WHEN CASE WHEN coalesce(current_setting('idem.session', true), '') NOT IN ('', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')))
                      THEN concat(CASE WHEN current_setting('search_path') <> split_part(current_setting('idem.session'), chr(31), 1) THEN set_config('search_path', split_part(current_setting('idem.session'), chr(31), 1), false) END,
                           CASE WHEN current_setting('default_transaction_read_only') <> split_part(current_setting('idem.session'), chr(31), 2) THEN set_config('default_transaction_read_only', split_part(current_setting('idem.session'), chr(31), 2), false) END,
                           CASE WHEN current_setting('default_transaction_isolation') <> split_part(current_setting('idem.session'), chr(31), 3) THEN set_config('default_transaction_isolation', split_part(current_setting('idem.session'), chr(31), 3), false) END,
                           CASE WHEN current_setting('statement_timeout') <> split_part(current_setting('idem.session'), chr(31), 4) THEN set_config('statement_timeout', split_part(current_setting('idem.session'), chr(31), 4), false) END,
                           CASE WHEN current_setting('synchronous_commit') <> split_part(current_setting('idem.session'), chr(31), 5) THEN set_config('synchronous_commit', split_part(current_setting('idem.session'), chr(31), 5), false) END,
                           CASE WHEN current_setting('session_replication_role') <> split_part(current_setting('idem.session'), chr(31), 6) THEN set_config('session_replication_role', split_part(current_setting('idem.session'), chr(31), 6), false) END,
                    CASE WHEN current_setting('role') <> split_part(current_setting('idem.session'), chr(31), 7) THEN set_config('role', split_part(current_setting('idem.session'), chr(31), 7), false) END) IS NULL END THEN false
            WHEN CASE WHEN pg_my_temp_schema() = 0 THEN false
                      ELSE coalesce(to_regclass('pg_temp.idem_keys'), to_regclass('pg_temp.idem_processed_events'), to_regclass('pg_temp.idem_outbox'),
                                    to_regclass('pg_temp.idem_dead_letters'), to_regclass('pg_temp.idem_relay_leader')) IS NOT NULL END
            THEN CAST(pg_my_temp_schema()::text || 'idem: a temporary table hides a table of the runtime' AS boolean)
            WHEN EXISTS (SELECT 1 FROM stored) THEN true
            ELSE idem_key_completed_elsewhere(@scope, @principal, @key) END::boolean;

-- name: StoreNewKey :exec
-- StoreKey for a key whose claim saw no row and wrote none (read committed:
-- GetKey, with a snapshot taken after the key's lock, found nothing), the
-- common first request: a plain INSERT, without StoreKey's speculative
-- insertion (ON CONFLICT) and CTE, which cost the backend CPU on every
-- first request for a conflict that needs a writer that did not take the
-- key's advisory lock. Such a row, committed after the claim, makes this
-- INSERT fail with a unique violation (23505) on idem_keys' primary key,
-- which the runtime treats as StoreKey's serialization failure: nothing
-- commits (the COMMIT pipelined after it is skipped) and the retry replays
-- the row, or takes it over when it has expired. An INSERT of the same key
-- in progress elsewhere is waited on (bounded by the lock_timeout, as
-- StoreKey's ON CONFLICT waits). The WHERE is StoreKey's first WHEN: the
-- check that this is still the transaction that claimed the key (22P02,
-- with the same message, when not). The TTL counts from this statement,
-- as StoreKey's. The other WHENs are StoreKey's (idem_keys moved, the
-- session's settings put back, a temporary table refused).
INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
SELECT CAST(@scope AS text), CAST(@principal AS text), CAST(@key AS text), CAST(@fingerprint AS bytea),
       CAST(@status_code AS integer), CAST(sqlc.arg(headers)::text AS jsonb), CAST(@body AS bytea),
       statement_timestamp() + make_interval(secs => @ttl_seconds::float8)
WHERE CASE WHEN coalesce(current_setting('idem.saved_lock_timeout', true), '') = ''
           THEN CAST(coalesce(current_setting('idem.saved_lock_timeout', true), '') || 'idem: not the transaction that claimed the key' AS boolean)
           WHEN coalesce(current_setting('idem.keys_rel', true), '') NOT IN ('', 'idem_keys'::regclass::oid::text)
           THEN CAST(coalesce(current_setting('idem.keys_rel', true), '') || 'idem: the function made idem_keys name another table' AS boolean)
           WHEN CASE WHEN coalesce(current_setting('idem.session', true), '') NOT IN ('', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')))
                     THEN concat(CASE WHEN current_setting('search_path') <> split_part(current_setting('idem.session'), chr(31), 1) THEN set_config('search_path', split_part(current_setting('idem.session'), chr(31), 1), false) END,
                          CASE WHEN current_setting('default_transaction_read_only') <> split_part(current_setting('idem.session'), chr(31), 2) THEN set_config('default_transaction_read_only', split_part(current_setting('idem.session'), chr(31), 2), false) END,
                          CASE WHEN current_setting('default_transaction_isolation') <> split_part(current_setting('idem.session'), chr(31), 3) THEN set_config('default_transaction_isolation', split_part(current_setting('idem.session'), chr(31), 3), false) END,
                          CASE WHEN current_setting('statement_timeout') <> split_part(current_setting('idem.session'), chr(31), 4) THEN set_config('statement_timeout', split_part(current_setting('idem.session'), chr(31), 4), false) END,
                          CASE WHEN current_setting('synchronous_commit') <> split_part(current_setting('idem.session'), chr(31), 5) THEN set_config('synchronous_commit', split_part(current_setting('idem.session'), chr(31), 5), false) END,
                          CASE WHEN current_setting('session_replication_role') <> split_part(current_setting('idem.session'), chr(31), 6) THEN set_config('session_replication_role', split_part(current_setting('idem.session'), chr(31), 6), false) END,
                    CASE WHEN current_setting('role') <> split_part(current_setting('idem.session'), chr(31), 7) THEN set_config('role', split_part(current_setting('idem.session'), chr(31), 7), false) END) IS NULL END THEN false
           WHEN CASE WHEN pg_my_temp_schema() = 0 THEN false
                     ELSE coalesce(to_regclass('pg_temp.idem_keys'), to_regclass('pg_temp.idem_processed_events'), to_regclass('pg_temp.idem_outbox'),
                                   to_regclass('pg_temp.idem_dead_letters'), to_regclass('pg_temp.idem_relay_leader')) IS NOT NULL END
           THEN CAST(pg_my_temp_schema()::text || 'idem: a temporary table hides a table of the runtime' AS boolean)
           ELSE true END;

-- name: CheckOwnTransaction :exec
-- Fails unless this is the transaction the runtime began: every runtime
-- BEGIN sets idem.saved_lock_timeout for its transaction (SetTxSettings or
-- SetLockTimeout), and a handler that ended it and chained another one
-- (COMMIT AND CHAIN, ROLLBACK AND CHAIN, ROLLBACK; BEGIN) is in a
-- transaction without it: its effect and the processed-event row were
-- committed or rolled back already, apart. Sent in the COMMIT's round trip,
-- before it, so that the failure (22P02, the message below; the text is
-- built from the setting so that it is not folded into a constant and
-- evaluated when the plan is made) skips the COMMIT. It also puts back the
-- session settings the handler changed (saved in idem.session by
-- InsertProcessedEvent(s)) and refuses a temporary table named like a
-- runtime table, as StoreKey does.
SELECT CASE WHEN coalesce(current_setting('idem.saved_lock_timeout', true), '') = ''
            THEN CAST(coalesce(current_setting('idem.saved_lock_timeout', true), '') || 'idem: not the transaction the runtime began' AS boolean)
            WHEN CASE WHEN coalesce(current_setting('idem.session', true), '') NOT IN ('', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')))
                      THEN concat(CASE WHEN current_setting('search_path') <> split_part(current_setting('idem.session'), chr(31), 1) THEN set_config('search_path', split_part(current_setting('idem.session'), chr(31), 1), false) END,
                           CASE WHEN current_setting('default_transaction_read_only') <> split_part(current_setting('idem.session'), chr(31), 2) THEN set_config('default_transaction_read_only', split_part(current_setting('idem.session'), chr(31), 2), false) END,
                           CASE WHEN current_setting('default_transaction_isolation') <> split_part(current_setting('idem.session'), chr(31), 3) THEN set_config('default_transaction_isolation', split_part(current_setting('idem.session'), chr(31), 3), false) END,
                           CASE WHEN current_setting('statement_timeout') <> split_part(current_setting('idem.session'), chr(31), 4) THEN set_config('statement_timeout', split_part(current_setting('idem.session'), chr(31), 4), false) END,
                           CASE WHEN current_setting('synchronous_commit') <> split_part(current_setting('idem.session'), chr(31), 5) THEN set_config('synchronous_commit', split_part(current_setting('idem.session'), chr(31), 5), false) END,
                           CASE WHEN current_setting('session_replication_role') <> split_part(current_setting('idem.session'), chr(31), 6) THEN set_config('session_replication_role', split_part(current_setting('idem.session'), chr(31), 6), false) END,
                    CASE WHEN current_setting('role') <> split_part(current_setting('idem.session'), chr(31), 7) THEN set_config('role', split_part(current_setting('idem.session'), chr(31), 7), false) END) IS NULL END THEN false
            WHEN CASE WHEN pg_my_temp_schema() = 0 THEN false
                      ELSE coalesce(to_regclass('pg_temp.idem_keys'), to_regclass('pg_temp.idem_processed_events'), to_regclass('pg_temp.idem_outbox'),
                                    to_regclass('pg_temp.idem_dead_letters'), to_regclass('pg_temp.idem_relay_leader')) IS NOT NULL END
            THEN CAST(pg_my_temp_schema()::text || 'idem: a temporary table hides a table of the runtime' AS boolean)
            ELSE true END::boolean;

-- name: RestoreSession :exec
-- Sent in the COMMIT's round trip of a request without a key, before it:
-- StoreKey's and CheckOwnTransaction's session part alone (see
-- CheckOwnTransaction). The part is written out in each of these four
-- statements, not called as a function of the runtime's schema: a function
-- is found through search_path, which is what a function's SET may have
-- moved. TestSessionGuardCopiesAgree (runtime/internal/dbx) keeps the
-- copies the same.
SELECT CASE WHEN CASE WHEN coalesce(current_setting('idem.session', true), '') NOT IN ('', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')))
                      THEN concat(CASE WHEN current_setting('search_path') <> split_part(current_setting('idem.session'), chr(31), 1) THEN set_config('search_path', split_part(current_setting('idem.session'), chr(31), 1), false) END,
                           CASE WHEN current_setting('default_transaction_read_only') <> split_part(current_setting('idem.session'), chr(31), 2) THEN set_config('default_transaction_read_only', split_part(current_setting('idem.session'), chr(31), 2), false) END,
                           CASE WHEN current_setting('default_transaction_isolation') <> split_part(current_setting('idem.session'), chr(31), 3) THEN set_config('default_transaction_isolation', split_part(current_setting('idem.session'), chr(31), 3), false) END,
                           CASE WHEN current_setting('statement_timeout') <> split_part(current_setting('idem.session'), chr(31), 4) THEN set_config('statement_timeout', split_part(current_setting('idem.session'), chr(31), 4), false) END,
                           CASE WHEN current_setting('synchronous_commit') <> split_part(current_setting('idem.session'), chr(31), 5) THEN set_config('synchronous_commit', split_part(current_setting('idem.session'), chr(31), 5), false) END,
                           CASE WHEN current_setting('session_replication_role') <> split_part(current_setting('idem.session'), chr(31), 6) THEN set_config('session_replication_role', split_part(current_setting('idem.session'), chr(31), 6), false) END,
                    CASE WHEN current_setting('role') <> split_part(current_setting('idem.session'), chr(31), 7) THEN set_config('role', split_part(current_setting('idem.session'), chr(31), 7), false) END) IS NULL END THEN false
            WHEN CASE WHEN pg_my_temp_schema() = 0 THEN false
                      ELSE coalesce(to_regclass('pg_temp.idem_keys'), to_regclass('pg_temp.idem_processed_events'), to_regclass('pg_temp.idem_outbox'),
                                    to_regclass('pg_temp.idem_dead_letters'), to_regclass('pg_temp.idem_relay_leader')) IS NOT NULL END
            THEN CAST(pg_my_temp_schema()::text || 'idem: a temporary table hides a table of the runtime' AS boolean)
            ELSE true END::boolean;

-- name: DeleteExpiredKeys :execrows
-- One bounded batch: PostgreSQL's DELETE has no LIMIT, so the victims are
-- chosen in a sub-select. SKIP LOCKED keeps retention from waiting on (or
-- blocking) a request that is taking over an expired key right now.
DELETE FROM idem_keys
WHERE (scope, principal, key) IN (
    SELECT k.scope, k.principal, k.key
    FROM idem_keys k
    WHERE k.expires_at <= now()
    ORDER BY k.expires_at
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: MigrateLock :exec
-- Serializes concurrent idem.Migrate calls (several pods starting at once):
-- CREATE ... IF NOT EXISTS alone can still fail when two sessions race. The
-- lock is per schema (the tables go into current_schema()), so services in
-- other schemas of the same database never wait for each other.
SELECT pg_advisory_xact_lock(hashtext('idem_migrate'), hashtext(current_schema()));

-- name: GetSchemaVersion :one
SELECT digest FROM idem_schema_version WHERE singleton;

-- name: SetSchemaVersion :exec
INSERT INTO idem_schema_version (digest) VALUES (@digest)
ON CONFLICT (singleton) DO UPDATE SET digest = EXCLUDED.digest, applied_at = now();

-- name: SetMigrateLockTimeout :exec
-- Bounds how long Migrate's DDL queues for a table lock behind running
-- requests (and makes new requests queue behind it) before it backs off.
SELECT set_config('lock_timeout', @lock_timeout::text, true);

-- name: InsertProcessedEvent :execrows
-- Records that context applied event_id. 0 rows: it already had (a
-- duplicate), and the handler must not run. It also makes the consumer's
-- transaction settings, which SetTxSettings sent as a statement of its own
-- before (one statement less per record): the mark idem.saved_lock_timeout
-- that CheckOwnTransaction checks, and idle_in_transaction_session_timeout
-- unless @idle is empty (see SetIdleInTransactionTimeout). The row
-- inserted is selected from the one-row settings CTE, so set_config has
-- run before the row is inserted or found a duplicate: the settings are in
-- effect for a duplicate too (a replayed dead letter commits one, checked)
-- and for everything after this statement (the handler; the idle timeout
-- only starts counting once the pipeline ends, as before). lock_timeout is
-- not set here: the table lock this INSERT takes (at Bind, before
-- set_config runs) waits with the session's lock_timeout, as it did after
-- SetTxSettings, which set none for the consumer either.
WITH settings AS MATERIALIZED (
    SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS mark,
           set_config('idem.session', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')), true) AS session,
           CASE WHEN @idle::text <> '' THEN set_config('idle_in_transaction_session_timeout', @idle::text, true) END AS idle
)
INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset)
SELECT @context, @event_id, @topic, @kpartition, @koffset FROM settings
ON CONFLICT (context, event_id) DO NOTHING;

-- name: InsertProcessedEvents :many
-- The batch form: one statement for a whole batch of one partition. Returns
-- the ids that were new; the others are duplicates. It makes the
-- transaction settings as InsertProcessedEvent does: the rows are selected
-- from the settings CTE. The id is returned COLLATE "C" whatever the
-- column's collation (a table of an earlier version has the database's):
-- a pooled connection's prepared statement then keeps its result type
-- across README's manual ALTER of the column to "C", which PostgreSQL
-- otherwise refuses to run again ("cached plan must not change result
-- type", 0A000: the batch failed once on every connection).
WITH settings AS MATERIALIZED (
    SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS mark,
           set_config('idem.session', concat_ws(chr(31), current_setting('search_path'), current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_setting('synchronous_commit'), current_setting('session_replication_role'), current_setting('role')), true) AS session,
           CASE WHEN @idle::text <> '' THEN set_config('idle_in_transaction_session_timeout', @idle::text, true) END AS idle
)
INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset)
SELECT @context, unnest(@event_ids::text[]), @topic, @kpartition, unnest(@koffsets::bigint[]) FROM settings
ON CONFLICT (context, event_id) DO NOTHING
RETURNING CAST(event_id COLLATE "C" AS text) AS event_id;

-- name: InsertDeadLetter :exec
-- A conflict is the same record (same bytes, same position) delivered again
-- after a crash between the dead-letter commit and the offset commit.
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, header_keys, header_values,
                               record_digest, attempts, last_error)
VALUES (@context, @topic, @kpartition, @koffset, @record_key, @value, @header_keys::bytea[], @header_values::bytea[],
        @record_digest, @attempts, @last_error)
ON CONFLICT (context, topic, kpartition, koffset, record_digest) DO NOTHING;

-- name: GetDeadLetter :one
SELECT id, context, topic, kpartition, koffset, record_key, value, header_keys, header_values,
       attempts, last_error, created_at, replayed_at
FROM idem_dead_letters
WHERE id = @id;

-- name: MarkDeadLetterReplayed :execrows
-- Runs in the replay's transaction, first: the row lock serializes concurrent
-- replays of one dead letter, and a replayed one is not replayed again.
UPDATE idem_dead_letters SET replayed_at = now()
WHERE id = @id AND replayed_at IS NULL;

-- name: DeadLetterReplayedAfterLock :one
-- Whether dead letter @id is marked replayed, read once no transaction
-- holds its row: FOR SHARE waits for a replay's transaction whose COMMIT
-- is still on its way (its answer lost) to end, so this reads that
-- transaction's outcome rather than the state before it.
SELECT replayed_at FROM idem_dead_letters WHERE id = @id FOR SHARE;

-- name: RecordDeadLetterFailure :exec
-- A replay that failed again: the dead letter stays, with the new error.
UPDATE idem_dead_letters SET attempts = attempts + @attempts, last_error = @last_error
WHERE id = @id AND replayed_at IS NULL;

-- name: DeleteProcessedEventsBefore :execrows
-- Oldest first through idem_processed_events_processed_at, so a batch reads
-- only the rows it deletes.
DELETE FROM idem_processed_events
WHERE (context, event_id) IN (
    SELECT p.context, p.event_id FROM idem_processed_events p
    WHERE p.processed_at < @before
    ORDER BY p.processed_at
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: EnqueueOutbox :exec
-- The headers are sent as text, as StoreKey's are: a pool that does not
-- describe statements would send a []byte as a bytea literal.
INSERT INTO idem_outbox (topic, record_key, payload, headers)
VALUES (@topic, @record_key, @payload, CAST(sqlc.arg(headers)::text AS jsonb));

-- name: ClaimOutboxBatch :many
-- Claims up to batch_size PENDING rows in id order for the leading relay,
-- under its lease token, for lease_seconds; nothing unless that token holds
-- the live lease. The lease row is read FOR SHARE, so a standby's takeover
-- waits for this claim to commit and its reset then returns the rows to
-- PENDING: a claim can never slip in behind a takeover. PostgreSQL's UPDATE
-- has no LIMIT, so the rows are picked in a CTE.
WITH l AS (
    SELECT 1 FROM idem_relay_leader
    WHERE name = @name AND token = @claim_token AND expires_at > now()
    FOR SHARE
), c AS (
    SELECT o.id FROM idem_outbox o
    WHERE o.status = 'PENDING' AND EXISTS (SELECT 1 FROM l)
    ORDER BY o.id
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
)
UPDATE idem_outbox o
SET status = 'PUBLISHING',
    claim_token = @claim_token,
    locked_until = now() + make_interval(secs => @lease_seconds::float8)
FROM c
WHERE o.id = c.id
RETURNING o.id, o.event_id, o.topic, o.record_key, o.payload, o.headers, o.attempts;

-- name: MarkOutboxPublished :execrows
-- Only the relay whose token claimed the rows, and is still the lease's
-- token, may mark them: one whose lease was taken over is refused (0 rows).
UPDATE idem_outbox
SET status = 'PUBLISHED', published_at = now(), claim_token = NULL, locked_until = NULL, last_error = NULL
WHERE id = ANY(@ids::bigint[]) AND claim_token = @claim_token AND status = 'PUBLISHING'
  AND EXISTS (SELECT 1 FROM idem_relay_leader l WHERE l.name = @name AND l.token = @claim_token);

-- name: MarkOutboxFailed :one
-- Returns failed rows to PENDING with their last_error. A counted failure
-- (the row's own: others of its batch got through) adds an attempt and parks
-- the row (PARKED) once it reaches max_attempts; a permanent one parks it at
-- once; an uncounted one (a broker-wide outage) changes neither. Conditional
-- on the claim token and the lease like MarkOutboxPublished. It reports how
-- many rows it marked and how many of them it parked. A row it parks gets
-- parked_at = now(): transaction time, which is this statement's start, as
-- the relay sends it alone (autocommit; it ran in no longer transaction);
-- idemctl's purge of parked rows counts their age from it. A row it
-- returns to PENDING gets none.
WITH marked AS (
  UPDATE idem_outbox o
  SET status = CASE WHEN f.permanent OR (f.counted AND o.attempts + 1 >= @max_attempts) THEN 'PARKED' ELSE 'PENDING' END,
      parked_at = CASE WHEN f.permanent OR (f.counted AND o.attempts + 1 >= @max_attempts) THEN now() END,
      attempts = o.attempts + CASE WHEN f.counted OR f.permanent THEN 1 ELSE 0 END,
      last_error = f.error,
      claim_token = NULL,
      locked_until = NULL
  FROM (SELECT unnest(@ids::bigint[]) AS id, unnest(@errors::text[]) AS error,
               unnest(@permanent::bool[]) AS permanent, unnest(@counted::bool[]) AS counted) f
  WHERE o.id = f.id AND o.claim_token = @claim_token AND o.status = 'PUBLISHING'
    AND EXISTS (SELECT 1 FROM idem_relay_leader l WHERE l.name = @name AND l.token = @claim_token)
  RETURNING o.status
)
SELECT count(*) AS marked, count(*) FILTER (WHERE status = 'PARKED') AS parked FROM marked;

-- name: ReapOutbox :execrows
-- Returns PUBLISHING rows whose row lease expired to PENDING.
UPDATE idem_outbox
SET status = 'PENDING', claim_token = NULL, locked_until = NULL
WHERE status = 'PUBLISHING' AND locked_until < now();

-- name: ResetOutboxPublishing :execrows
-- On taking over as the leading relay: every PUBLISHING row belongs to a
-- predecessor whose lease is over; return them all to PENDING before
-- publishing, so they go out again in id order. Only while token holds the
-- live lease, so a leader that froze right after taking over cannot reset
-- its successor's rows.
UPDATE idem_outbox
SET status = 'PENDING', claim_token = NULL, locked_until = NULL
WHERE status = 'PUBLISHING'
  AND EXISTS (SELECT 1 FROM idem_relay_leader l WHERE l.name = @name AND l.token = @token AND l.expires_at > now());

-- name: SetRelayStatementTimeout :exec
-- Bounds the lease queries on the server too (transaction-local), so a lease
-- statement stuck behind a lock cannot outlive the lease it renews, and a
-- relay frozen inside a lease transaction (SIGSTOP, a paused VM) loses its
-- session instead of holding the lease row's lock, and every standby's
-- takeover, until it wakes.
SELECT set_config('statement_timeout', @timeout::text, true),
       set_config('idle_in_transaction_session_timeout', @timeout::text, true);

-- name: AcquireRelayLease :one
-- Takes the lease for token when nobody holds it, the holder's lease has
-- expired (by PostgreSQL's clock), or holder itself held it (a relay that
-- stepped down after a failed renewal starts a new term at once, with a new
-- token that fences its old one). acquired is false when another holder has
-- a live lease; remaining_ms then says when it expires.
WITH taken AS (
    INSERT INTO idem_relay_leader AS l (name, holder, token, expires_at)
    VALUES (@name, @holder, @token, now() + make_interval(secs => @lease_seconds::float8))
    ON CONFLICT (name) DO UPDATE
    SET holder = EXCLUDED.holder, token = EXCLUDED.token, acquired_at = now(), expires_at = EXCLUDED.expires_at
    WHERE l.expires_at <= now() OR l.holder = EXCLUDED.holder
    RETURNING l.token
)
SELECT EXISTS (SELECT 1 FROM taken) AS acquired,
       coalesce((SELECT greatest(extract(epoch FROM c.expires_at - now()) * 1000, 0)::bigint
                 FROM idem_relay_leader c WHERE c.name = @name), 0)::bigint AS remaining_ms;

-- name: RenewRelayLease :execrows
-- Extends the lease held by token. 0 rows: another relay took it over.
UPDATE idem_relay_leader
SET expires_at = now() + make_interval(secs => @lease_seconds::float8)
WHERE name = @name AND token = @token;

-- name: ReleaseRelayLease :execrows
-- A leader stopping cleanly hands over at once instead of after the lease.
UPDATE idem_relay_leader
SET expires_at = now()
WHERE name = @name AND token = @token;

-- name: ListenOutbox :exec
LISTEN idem_outbox;

-- name: NotifyOutbox :exec
-- Wakes the relay (delivered at commit), e.g. after parked rows are requeued.
SELECT pg_notify('idem_outbox', '');

-- name: RequeueParkedOutbox :execrows
-- Returns PARKED rows to PENDING with a fresh attempt budget: every parked
-- row (all), those with the given ids, or those of the given topics. They go
-- out through the ordinary relay path (claim, publish, mark under the lease).
-- last_error is kept until the row is published; parked_at is cleared.
UPDATE idem_outbox
SET status = 'PENDING', attempts = 0, claim_token = NULL, locked_until = NULL, parked_at = NULL
WHERE status = 'PARKED'
  AND (@all_rows::bool OR id = ANY(@ids::bigint[]) OR topic = ANY(@topics::text[]));

-- name: RequeueParkedOutboxBatch :many
-- One batch of idemctl's requeue (admin.RequeueParkedBatch): up to
-- @batch_size PARKED rows with an id above @after, of one topic or all,
-- lowest ids first, back to PENDING as RequeueParkedOutbox does. The
-- caller pages by the highest id returned, so a batch never reads the rows
-- earlier batches requeued, and each batch commits on its own: a requeue
-- of millions of rows is not one statement that must finish within the
-- operator's timeout or roll back entirely.
UPDATE idem_outbox
SET status = 'PENDING', attempts = 0, claim_token = NULL, locked_until = NULL, parked_at = NULL
WHERE id IN (
    SELECT o.id FROM idem_outbox o
    WHERE o.status = 'PARKED' AND o.id > @after
      AND (sqlc.narg(topic)::text IS NULL OR o.topic = sqlc.narg(topic))
    ORDER BY o.id
    LIMIT @batch_size
    FOR UPDATE
)
  AND status = 'PARKED'
RETURNING id;

-- name: DeletePublishedOutbox :execrows
-- Oldest first by published_at, so the batch is read from the partial index
-- idem_outbox_published; ordering by id would walk the primary key through
-- every PENDING and recent row and filter them out.
DELETE FROM idem_outbox
WHERE id IN (
    SELECT o.id FROM idem_outbox o
    WHERE o.status = 'PUBLISHED' AND o.published_at < @before
    ORDER BY o.published_at
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: OutboxCounts :many
SELECT status, count(*)::bigint AS n FROM idem_outbox GROUP BY status;

-- name: DeleteKeysExpiredAgo :execrows
-- The janitor's batch: keys that expired at least @grace_seconds ago,
-- oldest first through idem_keys_expires_at. The database's clock decides,
-- as it does in ClaimKey: an application clock running ahead must not delete
-- a key that is still being replayed. SKIP LOCKED: a key being taken over by
-- a request right now is left alone.
DELETE FROM idem_keys
WHERE (scope, principal, key) IN (
    SELECT k.scope, k.principal, k.key
    FROM idem_keys k
    WHERE k.expires_at <= now() - make_interval(secs => @grace_seconds::float8)
    ORDER BY k.expires_at
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: DeleteDeadLettersBefore :execrows
-- Oldest first through idem_dead_letters_created_at.
DELETE FROM idem_dead_letters
WHERE id IN (
    SELECT d.id FROM idem_dead_letters d
    WHERE d.created_at < @before
    ORDER BY d.created_at
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: TryJanitorLock :one
-- Session-level, taken by a janitor for one run on the connection that runs
-- its batches: replicas that find it held skip their run. Keyed by the key
-- table's oid like TryRelayLock, so schemas of one database are independent.
SELECT pg_try_advisory_lock((7652::bigint << 32) | 'idem_keys'::regclass::oid::bigint);

-- name: JanitorUnlock :one
SELECT pg_advisory_unlock((7652::bigint << 32) | 'idem_keys'::regclass::oid::bigint);

-- name: OutboxStatus :one
-- Per-state counts for operators, each read from its partial index (PENDING,
-- PUBLISHING, PUBLISHED, PARKED), never a scan of the whole table; the oldest
-- PENDING row is the first entry of idem_outbox_pending.
SELECT
    (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PENDING')::bigint    AS pending,
    (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PUBLISHING')::bigint AS publishing,
    (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PUBLISHED')::bigint  AS published,
    (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PARKED')::bigint     AS parked,
    (SELECT o.created_at FROM idem_outbox o WHERE o.status = 'PENDING' ORDER BY o.id LIMIT 1)::timestamptz AS oldest_pending,
    now()::timestamptz AS now;

-- name: RelayLeader :many
-- The relay's leadership lease (idem_relay_leader), for operators.
SELECT name, holder, acquired_at, expires_at, (expires_at > now())::bool AS live,
       greatest(extract(epoch FROM expires_at - now()), 0)::float8 AS remaining_seconds
FROM idem_relay_leader
ORDER BY name;

-- name: ListParkedOutbox :many
-- parked_at is NULL for a row parked by a version without the column.
SELECT o.id, o.event_id, o.topic, o.record_key, o.attempts, o.created_at, o.parked_at,
       coalesce(o.last_error, '')::text AS last_error
FROM idem_outbox o
WHERE o.status = 'PARKED'
  AND (sqlc.narg(id)::bigint IS NULL OR o.id = sqlc.narg(id))
  AND (sqlc.narg(topic)::text IS NULL OR o.topic = sqlc.narg(topic))
  AND o.id > @after
ORDER BY o.id
LIMIT @max_rows;

-- name: CountParkedOutbox :one
-- How many PARKED rows ListParkedOutbox's filter matches in all, so a listing
-- cut at its limit (and requeue's dry run) can say how many there are.
SELECT count(*)::bigint FROM idem_outbox o
WHERE o.status = 'PARKED'
  AND (sqlc.narg(id)::bigint IS NULL OR o.id = sqlc.narg(id))
  AND (sqlc.narg(topic)::text IS NULL OR o.topic = sqlc.narg(topic));

-- name: OutboxRowStatus :one
-- What became of one outbox row, for a requeue by id that found it not
-- parked: PENDING, PUBLISHING or PUBLISHED (or no row at all).
SELECT status FROM idem_outbox WHERE id = @id;

-- name: CountOutboxBefore :one
-- For purge's dry run: rows in @status parked (PARKED) or published
-- (PUBLISHED) before @before. A PARKED row without parked_at (parked by a
-- version without the column) is not counted: its parking time is unknown
-- (CountParkedOutboxUnknownTime counts those).
SELECT count(*)::bigint FROM idem_outbox o
WHERE o.status = @status::text
  AND CASE WHEN @status::text = 'PUBLISHED' THEN o.published_at ELSE o.parked_at END < @before;

-- name: DatabaseNow :one
-- PostgreSQL's clock, which sets parked_at and published_at: idemctl's
-- purge counts its cutoff from it, not from the operator's machine (a
-- laptop clock 2 hours ahead made --older-than 1h delete rows parked a
-- minute ago).
SELECT now()::timestamptz AS now;

-- name: CountParkedOutboxUnknownTime :one
-- PARKED rows without parked_at (parked by a version without the column,
-- or before the upgrade that added it): a purge by age keeps them, and
-- says how many it kept.
SELECT count(*)::bigint FROM idem_outbox o
WHERE o.status = 'PARKED' AND o.parked_at IS NULL;

-- name: DeleteParkedOutbox :execrows
-- One batch of purge: rows parked before @before (by parked_at, not
-- created_at: an event enqueued long ago may have been parked a minute ago),
-- through idem_outbox_parked. A row without parked_at is never selected.
DELETE FROM idem_outbox
WHERE id IN (
    SELECT o.id FROM idem_outbox o
    WHERE o.status = 'PARKED' AND o.parked_at < @before
    ORDER BY o.id
    LIMIT @batch_size
    FOR UPDATE SKIP LOCKED
);

-- name: DeleteParkedOutboxByID :execrows
-- purge --parked --id: one PARKED row, whatever its age or parked_at (the
-- operator named it); 0 rows when it is not parked (requeued, published)
-- or does not exist.
DELETE FROM idem_outbox WHERE id = @id AND status = 'PARKED';

-- name: ListDeadLetters :many
-- Dead letters not yet replayed (all of them with @include_replayed).
SELECT d.id, d.context, d.topic, d.kpartition, d.koffset, d.attempts, d.last_error, d.created_at, d.replayed_at,
       coalesce(length(d.value), 0)::bigint AS value_len
FROM idem_dead_letters d
WHERE (sqlc.narg(context)::text IS NULL OR d.context = sqlc.narg(context))
  AND (sqlc.narg(topic)::text IS NULL OR d.topic = sqlc.narg(topic))
  AND (@include_replayed::bool OR d.replayed_at IS NULL)
  AND d.id > @after
ORDER BY d.id
LIMIT @max_rows;

-- name: CountDeadLetters :one
-- How many dead letters ListDeadLetters's filter matches in all.
SELECT count(*)::bigint FROM idem_dead_letters d
WHERE (sqlc.narg(context)::text IS NULL OR d.context = sqlc.narg(context))
  AND (sqlc.narg(topic)::text IS NULL OR d.topic = sqlc.narg(topic))
  AND (@include_replayed::bool OR d.replayed_at IS NULL);

-- name: OldestProcessedEvent :one
-- When the oldest processed-event row still kept was written (the first
-- entry of idem_processed_events_processed_at; NULL if none is): the
-- janitor deleted the rows before it, so a context that applied an event
-- before then no longer knows it did. idemctl's replay checks it.
SELECT min(processed_at)::timestamptz AS oldest FROM idem_processed_events;

-- name: DeleteDeadLetter :execrows
DELETE FROM idem_dead_letters WHERE id = @id;

-- name: AdminGetKey :one
-- A key as operators see it. FOR SHARE NOWAIT fails at once (55P03) when a
-- live transaction holds the row: a request taking over an expired key.
-- The key columns are returned COLLATE "C" whatever the table's collation,
-- as InsertProcessedEvents' id is: the statement prepared on a pooled
-- connection survives README's manual ALTER of the columns to "C".
SELECT CAST(scope COLLATE "C" AS text) AS scope, CAST(principal COLLATE "C" AS text) AS principal,
       CAST(key COLLATE "C" AS text) AS key, fingerprint, status_code, headers, body, created_at, expires_at,
       (expires_at <= now())::bool AS expired
FROM idem_keys
WHERE scope = @scope AND principal = @principal AND key = @key
FOR SHARE NOWAIT;

-- name: LockKeyNowait :one
-- Release's guard: the row, locked without waiting. A live transaction
-- holding it (a request in flight on this key) makes this fail with 55P03,
-- and release refuses rather than wait or break that request.
SELECT expires_at FROM idem_keys
WHERE scope = @scope AND principal = @principal AND key = @key
FOR UPDATE NOWAIT;

-- name: DeleteKey :execrows
DELETE FROM idem_keys WHERE scope = @scope AND principal = @principal AND key = @key;

-- name: OutboxLag :one
-- What the observable gauges report, cheap enough to read at every metrics
-- collection: each count is read from its partial index (never the
-- PUBLISHED history), and the oldest PENDING row is the first entry of
-- idem_outbox_pending.
SELECT
    ((SELECT count(*) FROM idem_outbox o WHERE o.status = 'PENDING')
     + (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PUBLISHING'))::bigint AS pending,
    (SELECT count(*) FROM idem_outbox o WHERE o.status = 'PARKED')::bigint AS parked,
    (SELECT count(*) FROM idem_dead_letters d WHERE d.replayed_at IS NULL)::bigint AS dead_letters,
    COALESCE(EXTRACT(EPOCH FROM now() - (SELECT o.created_at FROM idem_outbox o WHERE o.status = 'PENDING' ORDER BY o.id LIMIT 1)), 0)::float8 AS oldest_pending_seconds;
