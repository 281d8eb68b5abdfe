package txescape

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"sqlcdb"
)

type ChargeRequest struct{ OrderID string }
type Receipt struct{ ID int64 }
type OrderConfirmed struct{ EventID, OrderID string }

type Service struct {
	pool    *pgxpool.Pool
	conn    *pgx.Conn
	queries *sqlcdb.Queries
}

//idem:http route="POST /payments" status=201
func (s *Service) Charge(ctx context.Context, tx pgx.Tx, req ChargeRequest) (Receipt, error) {
	c, err := sqlcdb.New(tx).InsertCharge(ctx, req.OrderID)
	if err != nil {
		return Receipt{}, err
	}
	if _, err := s.pool.Exec(ctx, "insert into audit values ($1)", req.OrderID); err != nil { // want `//idem:http function writes through \*pgxpool.Pool, outside the operation's transaction: the write is not undone when the operation rolls back and is repeated on every retry \(double charge\); use the tx`
		return Receipt{}, err
	}
	if err := sqlcdb.New(s.pool).MarkPaid(ctx, req.OrderID); err != nil { // want `writes through sqlc Queries not built from the operation's tx`
		return Receipt{}, err
	}
	if _, err := s.queries.InsertCharge(ctx, req.OrderID); err != nil { // want `writes through sqlc Queries not built from the operation's tx`
		return Receipt{}, err
	}
	var n int
	if err := s.pool.QueryRow(ctx, "select count(*) from charges").Scan(&n); err != nil { // want `//idem:http function reads through \*pgxpool.Pool, outside the operation's transaction: the read does not see the operation's own writes`
		return Receipt{}, err
	}
	if err := tx.Commit(ctx); err != nil { // want `//idem:http function calls Commit on the operation's transaction: the generated wrapper commits it together with the key claim and stored response`
		return Receipt{}, err
	}
	return Receipt{ID: c.ID}, nil
}

//idem:consume topic=orders.confirmed
func (s *Service) HandleOrderConfirmed(ctx context.Context, tx pgx.Tx, ev OrderConfirmed) error {
	if _, err := s.conn.Exec(ctx, "update orders set paid = true"); err != nil { // want `//idem:consume function writes through \*pgx.Conn, outside the operation's transaction: .* \(a duplicate effect per redelivery\)`
		tx.Rollback(ctx) // want `//idem:consume function calls Rollback on the operation's transaction: the generated wrapper commits it together with the processed-event row`
		return err
	}
	other, err := s.pool.Begin(ctx) // want `//idem:consume function writes through \*pgxpool.Pool`
	if err != nil {
		return err
	}
	defer other.Rollback(ctx)
	//idemvet:ignore txescape the audit log must survive a rollback, and duplicates are harmless
	if _, err := s.pool.Exec(ctx, "insert into audit"); err != nil {
		return err
	}
	return nil
}

// True negatives: the example's shapes.

func enqueue(ctx context.Context, tx pgx.Tx, v any) error { return nil }

//idem:http route="POST /orders"
func (s *Service) Create(ctx context.Context, tx pgx.Tx, req ChargeRequest) (Receipt, error) {
	q := sqlcdb.New(tx)
	c, err := q.InsertCharge(ctx, req.OrderID)
	if err != nil {
		return Receipt{}, err
	}
	if err := s.queries.WithTx(tx).MarkPaid(ctx, req.OrderID); err != nil {
		return Receipt{}, err
	}
	// A savepoint inside the operation's transaction is fine to commit.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return Receipt{}, err
	}
	if _, err := sp.Exec(ctx, "insert"); err != nil {
		return Receipt{}, err
	}
	if err := sp.Commit(ctx); err != nil {
		return Receipt{}, err
	}
	return Receipt{ID: c.ID}, enqueue(ctx, tx, c)
}

// Not annotated: a function that owns its transaction may commit it.
func (s *Service) Own(ctx context.Context) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := s.pool.Exec(ctx, "insert"); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// The generated wrapper's shape (examples/payments/idem_gen.go): no directive, nothing to report.
var _ func(*Service, context.Context, pgx.Tx, ChargeRequest) (Receipt, error) = (*Service).Charge

func (s *Service) ChargeHandler() func(context.Context, pgx.Tx, ChargeRequest) (Receipt, error) {
	return s.Charge
}

// Found by review (vetfix): pgx.BeginFunc on the pool is a transaction of its
// own, and a statement on tx.Conn() runs inside the operation's transaction.
//
//idem:http route="POST /refunds"
func (s *Service) Refund(ctx context.Context, tx pgx.Tx, req ChargeRequest) (Receipt, error) {
	if err := pgx.BeginFunc(ctx, s.pool, func(t2 pgx.Tx) error { // want `//idem:http function writes through \*pgxpool.Pool \(pgx.BeginFunc\), outside the operation's transaction`
		_, err := t2.Exec(ctx, "insert into audit")
		return err
	}); err != nil {
		return Receipt{}, err
	}
	// A savepoint on the operation's tx is fine.
	if err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
		_, err := sp.Exec(ctx, "insert")
		return err
	}); err != nil {
		return Receipt{}, err
	}
	if _, err := tx.Conn().Exec(ctx, "insert into charges"); err != nil {
		return Receipt{}, err
	}
	return Receipt{}, nil
}
