-- name: RecordCall :exec
INSERT INTO provider_calls (idempotency_key, order_id) VALUES (@idempotency_key, @order_id);

-- name: ApplyCharge :one
-- Applies the charge unless one with this key exists; no row then. A
-- concurrent call with the same key waits for the first one's commit.
INSERT INTO provider_charges (idempotency_key, order_id, amount, currency)
VALUES (@idempotency_key, @order_id, @amount, @currency)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, idempotency_key, order_id, amount, currency, created_at;

-- name: GetCharge :one
SELECT id, idempotency_key, order_id, amount, currency, created_at
FROM provider_charges WHERE idempotency_key = @idempotency_key;

-- name: CountCalls :one
SELECT count(*) FROM provider_calls WHERE order_id = @order_id;

-- name: CountCharges :one
SELECT count(*) FROM provider_charges WHERE order_id = @order_id;
