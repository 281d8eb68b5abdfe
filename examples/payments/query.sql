-- name: InsertCharge :one
INSERT INTO charges (order_id, amount, currency, provider_key)
VALUES (@order_id, @amount, @currency, @provider_key)
RETURNING id, order_id, amount, currency, provider_key, created_at;

-- name: CountCharges :one
SELECT count(*) FROM charges WHERE order_id = @order_id;
