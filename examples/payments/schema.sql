-- The payments service's own tables. idemgen's tables come from
-- runtime.Migrate (or `idemgen schema`).
CREATE TABLE IF NOT EXISTS charges (
    id           bigserial   PRIMARY KEY,
    order_id     text        NOT NULL,
    amount       bigint      NOT NULL CHECK (amount > 0),
    currency     text        NOT NULL,
    -- The key sent to the payment provider: derived from the request's
    -- Idempotency-Key, so every retry of one charge sends the same one.
    provider_key text        NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Receipts sent by the notifications context, one per billing.charged event.
CREATE TABLE IF NOT EXISTS notifications (
    id         bigserial   PRIMARY KEY,
    charge_id  bigint      NOT NULL,
    order_id   text        NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);
