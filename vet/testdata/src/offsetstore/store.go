// Package offsetstore commits a transaction in a helper, in another package
// than the consumer that calls it.
package offsetstore

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

type Store struct{ Pool *pgxpool.Pool }

func (s *Store) Save(ctx context.Context, v string) error { // want Save:"commitsTx"
	return pgx.BeginFunc(ctx, s.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "insert", v)
		return err
	})
}
