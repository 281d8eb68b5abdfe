-- name: SetLockTimeout :exec
-- Bounds how long a claim waits for a concurrent in-flight duplicate. The
-- previous value is kept in idem.saved_lock_timeout so RestoreLockTimeout can
-- put it back: the wait bound must not leak into the handler's own queries.
SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true),
       set_config('lock_timeout', @lock_timeout::text, true);

-- name: RestoreLockTimeout :exec
SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true);

-- name: ClaimKey :execrows
-- Claims (scope, principal, key) for this transaction. Returns 1 row when the
-- key is new or its previous row has expired (the expired row is taken over),
-- 0 when a live row exists. A concurrent uncommitted claim makes this wait
-- until that transaction ends (bounded by lock_timeout).
INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at)
VALUES (@scope, @principal, @key, @fingerprint, now() + make_interval(secs => @ttl_seconds::float8))
ON CONFLICT (scope, principal, key) DO UPDATE
SET fingerprint = EXCLUDED.fingerprint,
    status_code = 0,
    headers     = '{}',
    body        = '',
    created_at  = now(),
    expires_at  = EXCLUDED.expires_at
WHERE idem_keys.expires_at <= now();

-- name: GetKey :one
SELECT fingerprint, status_code, headers, body, expires_at
FROM idem_keys
WHERE scope = @scope AND principal = @principal AND key = @key;

-- name: CompleteKey :execrows
UPDATE idem_keys
SET status_code = @status_code, headers = @headers, body = @body
WHERE scope = @scope AND principal = @principal AND key = @key;

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
-- Serializes concurrent runtime.Migrate calls (several pods starting at once):
-- CREATE ... IF NOT EXISTS alone can still fail when two sessions race.
SELECT pg_advisory_xact_lock(7164539873465300001);
