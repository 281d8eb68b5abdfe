package main

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/examples/payments/db"
)

// OrderChargesRequest is GET /orders/{order}/charges: the order comes from
// the path (request binding), there is no body.
type OrderChargesRequest struct {
	OrderID string `path:"order"`
}

// OrderCharges is the response of GET /orders/{order}/charges.
type OrderCharges struct {
	OrderID string `json:"order_id"`
	Charges int64  `json:"charges"`
}

// Charges reports how many charges an order has: what a client that lost a
// response checks before deciding anything. A read needs no key
// (key=optional); with one, a retry gets the answer the first request got.
//
//idem:http route="GET /orders/{order}/charges" key=optional
func (s *PaymentService) Charges(ctx context.Context, tx pgx.Tx, req OrderChargesRequest) (OrderCharges, error) {
	n, err := db.New(tx).CountCharges(ctx, req.OrderID)
	if err != nil {
		return OrderCharges{}, err
	}
	return OrderCharges{OrderID: req.OrderID, Charges: n}, nil
}
