package idem

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/templates"
)

// Store is idemgen's PostgreSQL storage: the idempotency-key table and its
// retention. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
	q    *db.Queries
}

// NewStore returns a Store on pool. The tables must exist: call Migrate once at
// start-up, or apply the output of `idemgen schema` with your migration tool.
func NewStore(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool, q: db.New(pool)}
}

// Schema returns the DDL that Migrate applies; `idemgen schema` prints it.
func Schema() string { return templates.Schema }

// Migrate creates idemgen's tables if they do not exist, in the first schema
// of the connection's search_path. Concurrent calls (several replicas starting
// together) are serialized with a transaction-scoped advisory lock.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("migrate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	if err := db.New(tx).MigrateLock(ctx); err != nil {
		return fmt.Errorf("migrate: lock: %w", err)
	}
	// The schema is several statements; only the simple protocol runs them in
	// one call.
	if _, err := tx.Conn().PgConn().Exec(ctx, templates.Schema).ReadAll(); err != nil {
		return fmt.Errorf("migrate: apply schema: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("migrate: commit: %w", err)
	}
	return nil
}

// DeleteExpiredKeys deletes up to batchSize expired idempotency keys and
// returns how many it deleted. Rows locked by a request that is taking over an
// expired key right now are skipped, never waited on.
func (s *Store) DeleteExpiredKeys(ctx context.Context, batchSize int) (int64, error) {
	if batchSize <= 0 {
		return 0, errors.New("delete expired keys: batch size must be positive")
	}
	n, err := s.q.DeleteExpiredKeys(ctx, int32(batchSize))
	if err != nil {
		return 0, fmt.Errorf("delete expired keys: %w", err)
	}
	return n, nil
}

// PurgeExpiredKeys deletes expired keys in batches of batchSize, each in its
// own short transaction, until a batch comes back short. It returns the total
// deleted. Cancelling ctx stops it between batches; committed batches stay.
func (s *Store) PurgeExpiredKeys(ctx context.Context, batchSize int) (int64, error) {
	var total int64
	for {
		n, err := s.DeleteExpiredKeys(ctx, batchSize)
		total += n
		if err != nil || n < int64(batchSize) {
			return total, err
		}
	}
}

// rollback ends tx when the work did not commit. It must run even when ctx is
// already cancelled (the usual reason for rolling back), so it uses a context
// that keeps ctx's values but not its cancellation; if the server is gone the
// connection is closed, which rolls back just the same.
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(ctx)
}
