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
