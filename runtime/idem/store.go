package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

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

// SchemaVersion identifies the schema this runtime needs: the SHA-256 of
// Schema(). Migrate records it in idem_schema_version after applying it.
func SchemaVersion() string {
	sum := sha256.Sum256([]byte(templates.Schema))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// migrateLockTimeout bounds how long Migrate's DDL queues for a table lock.
// While it queues, running replicas' new claims queue behind it, so it backs
// off quickly and tries again rather than stall them.
const migrateLockTimeout = time.Second

// Migrate creates or updates idemgen's tables, in the first schema of the
// connection's search_path.
//
// When the schema is current (idem_schema_version holds SchemaVersion) it
// only reads that row: no DDL, and no lock that a running replica's requests
// could queue behind, so starting a replica never stalls the others.
// Otherwise it applies Schema() under a transaction-scoped advisory lock, so
// any number of processes may call it at once: one applies, the others then
// find the schema current. Its DDL waits at most a second for a table lock
// before backing off and trying again, until ctx is done.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	want := SchemaVersion()
	have, err := db.New(pool).GetSchemaVersion(ctx)
	switch {
	case err == nil && have == want:
		return nil
	case err != nil && !errors.Is(err, pgx.ErrNoRows) && pgCode(err) != "42P01": // 42P01: no version table yet
		return fmt.Errorf("migrate: read schema version: %w", err)
	}
	backoff := 50 * time.Millisecond
	for {
		err := migrate(ctx, pool, want)
		if pgCode(err) != "55P03" {
			return err
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("migrate: tables stayed locked by running requests: %w", err)
		}
		backoff = min(2*backoff, time.Second)
	}
}

// migrate is one attempt of Migrate, in one transaction. It runs at read
// committed whatever the session's default_transaction_isolation: the
// version read after the advisory lock must see what the process that held
// it committed, and under repeatable read or serializable the snapshot,
// taken by the lock's statement before its wait, did not (the schema
// applied again failed: 42P07 "relation idem_keys_expires_at already
// exists", or 40001 recording the version; TestSessionDefaultIsolationConcurrentMigrate).
func migrate(ctx context.Context, pool *pgxpool.Pool, want string) error {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return fmt.Errorf("migrate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	q := db.New(tx)
	if err := q.MigrateLock(ctx); err != nil {
		return fmt.Errorf("migrate: lock: %w", err)
	}
	// Another process may have applied it while we waited for the lock. A
	// savepoint keeps a missing version table from aborting the transaction.
	if current, err := schemaCurrent(ctx, tx, want); err != nil || current {
		return err
	}
	if err := q.SetMigrateLockTimeout(ctx, strconv.FormatInt(migrateLockTimeout.Milliseconds(), 10)+"ms"); err != nil {
		return fmt.Errorf("migrate: set lock timeout: %w", err)
	}
	// The schema is several statements; only the simple protocol runs them in
	// one call.
	if _, err := tx.Conn().PgConn().Exec(ctx, templates.Schema).ReadAll(); err != nil {
		return fmt.Errorf("migrate: apply schema: %w", err)
	}
	if err := q.SetSchemaVersion(ctx, want); err != nil {
		return fmt.Errorf("migrate: record schema version: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("migrate: commit: %w", err)
	}
	return nil
}

// schemaCurrent reports whether idem_schema_version holds want, reading it
// in a savepoint of tx.
func schemaCurrent(ctx context.Context, tx pgx.Tx, want string) (bool, error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("migrate: savepoint: %w", err)
	}
	have, err := db.New(sp).GetSchemaVersion(ctx)
	if err != nil {
		_ = sp.Rollback(ctx)
		if errors.Is(err, pgx.ErrNoRows) || pgCode(err) == "42P01" {
			return false, nil
		}
		return false, fmt.Errorf("migrate: read schema version: %w", err)
	}
	if err := sp.Commit(ctx); err != nil {
		return false, fmt.Errorf("migrate: release savepoint: %w", err)
	}
	return have == want, nil
}

// DeleteExpiredKeys deletes up to batchSize expired idempotency keys and
// returns how many it deleted. Rows locked by a request that is taking over an
// expired key right now are skipped, never waited on.
func (s *Store) DeleteExpiredKeys(ctx context.Context, batchSize int) (int64, error) {
	if batchSize <= 0 {
		return 0, errors.New("delete expired keys: batch size must be positive")
	}
	// At read committed whatever the session's default isolation
	// (readCommittedDB: BEGIN, the DELETE and COMMIT in one round trip, as
	// the statement alone): a key taken over and completed after the
	// DELETE began is re-checked (and kept), where repeatable read and
	// serializable failed the batch with 40001
	// (TestSessionDefaultIsolationPurgeExpiredKeysRacingATakeover).
	n, err := db.New(readCommittedDB{s.pool}).DeleteExpiredKeys(ctx, int32(batchSize))
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
