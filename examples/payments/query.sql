-- name: InsertCharge :one
INSERT INTO charges (order_id, amount, currency, provider_key)
VALUES (@order_id, @amount, @currency, @provider_key)
RETURNING id, order_id, amount, currency, provider_key, created_at;

-- name: CountCharges :one
SELECT count(*) FROM charges WHERE order_id = @order_id;

-- name: InsertNotification :exec
INSERT INTO notifications (charge_id, order_id) VALUES (@charge_id, @order_id);

-- name: CountNotifications :one
SELECT count(*) FROM notifications WHERE order_id = @order_id;

-- name: LockSchema :exec
-- Serializes the service's own CREATE TABLE IF NOT EXISTS across replicas
-- starting together: without it, two sessions creating one table race on
-- its row type (pg_type_typname_nsp_index).
SELECT pg_advisory_xact_lock(7164539873465300002);
