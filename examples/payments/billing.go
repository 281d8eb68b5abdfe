package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/examples/payments/db"
	idem "github.com/idemgen/idemgen/runtime"
)

// OrderConfirmed arrives on orders.confirmed from the orders service.
type OrderConfirmed struct {
	EventID  string `json:"event_id"`
	OrderID  string `json:"order_id"`
	Total    int64  `json:"total"`
	Currency string `json:"currency"`
}

// PaymentCharged is published on billing.charged after a charge commits.
//
//idem:outbox topic=billing.charged key=OrderID
type PaymentCharged struct {
	ChargeID int64  `json:"charge_id"`
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// Billing charges confirmed orders.
type Billing struct{}

// HandleOrderConfirmed is the seed's Kafka listener: it charges the order
// and announces the charge, once per event however often it is delivered.
//
//idem:consume topic=orders.confirmed context=billing id=EventID
func (b *Billing) HandleOrderConfirmed(ctx context.Context, tx pgx.Tx, ev OrderConfirmed) error {
	// The provider key derives from the event: every redelivery of this
	// event sends the provider the same key.
	key, _ := idem.KeyFromContext(ctx)
	charge, err := db.New(tx).InsertCharge(ctx, db.InsertChargeParams{
		OrderID:     ev.OrderID,
		Amount:      ev.Total,
		Currency:    ev.Currency,
		ProviderKey: key.Derive("provider.charge"),
	})
	if err != nil {
		return fmt.Errorf("charge order %s: %w", ev.OrderID, err)
	}
	return EnqueuePaymentCharged(ctx, tx, PaymentCharged{
		ChargeID: charge.ID, OrderID: charge.OrderID, Amount: charge.Amount, Currency: charge.Currency,
	})
}

// Notifications sends receipts.
type Notifications struct{}

// SendReceipt records one receipt per charge. Its events come from the
// outbox relay, which may deliver one twice after a crash; the event id in
// the idem-event-id header deduplicates them.
//
//idem:consume topic=billing.charged context=notifications
func (n *Notifications) SendReceipt(ctx context.Context, tx pgx.Tx, ev PaymentCharged) error {
	return db.New(tx).InsertNotification(ctx, db.InsertNotificationParams{ChargeID: ev.ChargeID, OrderID: ev.OrderID})
}
