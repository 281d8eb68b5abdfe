-- The payment provider's own tables. In production the provider is another
-- company's service with its own database; in this example it is a separate
-- HTTP server (`payments provider`) with its own tables, prefixed provider_,
-- which the payments service never reads or writes.

-- One row per applied charge: the unique Idempotency-Key is what makes the
-- provider apply a charge once however often the service retries.
CREATE TABLE IF NOT EXISTS provider_charges (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE,
    order_id        text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- One row per raw call received, committed before the charge is applied, so
-- retries and replays are counted too.
CREATE TABLE IF NOT EXISTS provider_calls (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL,
    order_id        text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS provider_calls_order_id ON provider_calls (order_id);
CREATE INDEX IF NOT EXISTS provider_charges_order_id ON provider_charges (order_id);
