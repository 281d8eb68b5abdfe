package main

//go:generate go run github.com/idemgen/idemgen/cmd/idemgen

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/examples/payments/db"
	"github.com/idemgen/idemgen/examples/payments/provider"
	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/idem"
)

// ChargeRequest is the body of POST /payments.
type ChargeRequest struct {
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// PaymentReceipt is the response of POST /payments.
type PaymentReceipt struct {
	ChargeID    int64     `json:"charge_id"`
	OrderID     string    `json:"order_id"`
	Amount      int64     `json:"amount"`
	Currency    string    `json:"currency"`
	ProviderKey string    `json:"provider_key"`
	CreatedAt   time.Time `json:"created_at"`
}

// PaymentService charges orders.
type PaymentService struct{}

// Charge records a charge for an order. idemgen wraps it so that each
// Idempotency-Key charges once, however often the client retries.
//
//idem:http route="POST /payments" status=201 ttl=24h
func (s *PaymentService) Charge(ctx context.Context, tx pgx.Tx, req ChargeRequest) (PaymentReceipt, error) {
	if req.OrderID == "" || req.Amount <= 0 || len(req.Currency) != 3 {
		return PaymentReceipt{}, idem.Errorf(http.StatusUnprocessableEntity,
			"order_id, a positive amount and a 3-letter currency are required")
	}
	charge, err := chargeOrder(ctx, tx, req.OrderID, req.Amount, req.Currency)
	if err != nil {
		return PaymentReceipt{}, err
	}
	idem.ResponseHeader(ctx).Set("Location", fmt.Sprintf("/payments/%d", charge.ID))
	return PaymentReceipt{
		ChargeID:    charge.ID,
		OrderID:     charge.OrderID,
		Amount:      charge.Amount,
		Currency:    charge.Currency,
		ProviderKey: charge.ProviderKey,
		CreatedAt:   charge.CreatedAt.Time,
	}, nil
}

// chargeOrder charges an order at the payment provider, records the charge
// and announces it through the outbox, in tx. The provider gets a key derived
// from the operation's own key (the HTTP Idempotency-Key, or the consumed
// event's id): the same on every attempt of the call and on every re-run of
// this operation after a rollback or a crash, so the provider applies the
// charge once even when the service's commit never happened — the seed's
// double protection.
func chargeOrder(ctx context.Context, tx pgx.Tx, orderID string, amount int64, currency string) (db.Charge, error) {
	providerKey, ok := idem.CallKey(ctx, providerChargeCall)
	if !ok {
		return db.Charge{}, fmt.Errorf("charge order %s: not inside an idempotent operation", orderID)
	}
	if _, err := currentProvider().charge(ctx, provider.ChargeRequest{OrderID: orderID, Amount: amount, Currency: currency}); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return db.Charge{}, ctxErr
		}
		if perr := (*providerError)(nil); errors.As(err, &perr) && perr.refused() {
			return db.Charge{}, &idem.Error{Status: http.StatusUnprocessableEntity,
				Detail: "the payment provider refused the charge: " + perr.body, Err: err}
		}
		// Nothing is stored and the key stays free: the client's retry
		// reaches the provider with the same key.
		return db.Charge{}, &idem.Error{Status: http.StatusBadGateway,
			Detail: "the payment provider did not confirm the charge; retry with the same Idempotency-Key", Err: err}
	}
	// The provider has charged; the commit below has not happened yet.
	crash.Point(ctx, "charge.after-provider-call")
	charge, err := db.New(tx).InsertCharge(ctx, db.InsertChargeParams{
		OrderID:     orderID,
		Amount:      amount,
		Currency:    currency,
		ProviderKey: providerKey,
	})
	if err != nil {
		return db.Charge{}, fmt.Errorf("charge order %s: %w", orderID, err)
	}
	err = EnqueuePaymentCharged(ctx, tx, PaymentCharged{
		ChargeID: charge.ID, OrderID: charge.OrderID, Amount: charge.Amount, Currency: charge.Currency,
	})
	return charge, err
}
