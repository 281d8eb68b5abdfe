package main

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/examples/payments/db"
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
	_, err := chargeOrder(ctx, tx, ev.OrderID, ev.Total, ev.Currency)
	return err
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
