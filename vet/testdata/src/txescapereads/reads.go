package txescapereads

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"sqlcdb"
)

type Service struct {
	pool    *pgxpool.Pool
	queries *sqlcdb.Queries
}

type Req struct{ OrderID string }

// With -txescape.allowreads, reads through the pool pass and writes do not.
//
//idem:http route="POST /x"
func (s *Service) Charge(ctx context.Context, tx pgx.Tx, req Req) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM charges WHERE order_id = $1", req.OrderID).Scan(&n); err != nil {
		return 0, err
	}
	if _, err := s.queries.GetCharge(ctx, req.OrderID); err != nil {
		return 0, err
	}
	if err := s.pool.QueryRow(ctx, "SELECT id FROM charges FOR UPDATE").Scan(&n); err != nil { // want `writes through \*pgxpool.Pool`
		return 0, err
	}
	if err := s.pool.QueryRow(ctx, "INSERT INTO charges DEFAULT VALUES RETURNING id").Scan(&n); err != nil { // want `writes through \*pgxpool.Pool`
		return 0, err
	}
	if _, err := s.queries.InsertCharge(ctx, req.OrderID); err != nil { // want `writes through sqlc Queries`
		return 0, err
	}
	return n, nil
}
