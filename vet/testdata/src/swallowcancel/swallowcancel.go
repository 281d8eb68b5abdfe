package swallowcancel

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"sqlcdb"
)

func work(ctx context.Context) error { return nil }

// The seed's mistake: "except CancelledError: pass" inside a transaction.
func handleSwallow(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "insert"); err != nil {
		return err
	}
	if err := work(ctx); err != nil {
		if errors.Is(err, context.Canceled) { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\): the caller sees success`
			return nil
		}
		return err
	}
	return nil
}

func handleDeadline(ctx context.Context, tx pgx.Tx, items []string) error {
	for _, it := range items {
		err := work(ctx)
		if err == context.DeadlineExceeded { // want `cancellation is swallowed inside a transaction \(the branch continues\)`
			continue
		}
		if _, err := tx.Exec(ctx, it); err != nil {
			return err
		}
	}
	return nil
}

func handleCtxErr(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	if ctx.Err() != nil { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return 0, nil
	}
	return 1, tx.Commit(ctx)
}

func handleCleared(ctx context.Context, tx pgx.Tx) error {
	err := work(ctx)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) { // want `\(the error is set to nil\)`
		err = nil
	}
	return err
}

func handleDone(ctx context.Context, tx pgx.Tx, in <-chan string) error {
	for {
		select {
		case <-ctx.Done(): // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
			return nil
		case s := <-in:
			if _, err := tx.Exec(ctx, s); err != nil {
				return err
			}
		}
	}
}

// Dropped errors of the transaction's own calls.
func dropped(ctx context.Context, tx pgx.Tx) error {
	tx.Exec(ctx, "insert")        // want `error of Exec on the transaction is dropped`
	_, _ = tx.Exec(ctx, "insert") // want `error of Exec on the transaction is dropped`
	q := sqlcdb.New(tx)
	q.MarkPaid(ctx, "o1")            // want `error of MarkPaid on the transaction is dropped`
	_, _ = q.InsertCharge(ctx, "o1") // want `error of InsertCharge on the transaction is dropped`
	defer tx.Commit(ctx)             // want `error of Commit is dropped`
	_ = tx.Commit(ctx)               // want `error of Commit is dropped`
	//idemvet:ignore swallowcancel best effort audit row; its failure must not fail the charge
	tx.Exec(ctx, "insert audit")
	return nil
}

// True negatives.

// The seed's correct pattern: re-raise.
func reraise(ctx context.Context, tx pgx.Tx) error {
	if err := work(ctx); err != nil {
		if errors.Is(err, context.Canceled) {
			return fmt.Errorf("charge: %w", err)
		}
		return err
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	default:
	}
	return nil
}

// An explicit rollback before returning nil is what the seed allows.
func explicitRollback(ctx context.Context, pool *pgxpool.Pool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	if errors.Is(work(ctx), context.Canceled) {
		_ = tx.Rollback(ctx)
		return nil
	}
	if _, err := tx.Exec(ctx, "insert"); err != nil {
		tx.Rollback(ctx)
		return err
	}
	return tx.Commit(ctx)
}

// Not cancelled: the else branch is the cancellation one, and it re-raises.
func negated(ctx context.Context, tx pgx.Tx) error {
	err := work(ctx)
	if !errors.Is(err, context.Canceled) {
		return nil
	} else {
		return err
	}
}

// No transaction: swallowing cancellation here is another tool's business.
func noTx(ctx context.Context) error {
	if errors.Is(work(ctx), context.Canceled) {
		return nil
	}
	return nil
}

// pgx's Rows carry the query's error: rows, _ := tx.Query(...) then
// rows.Err() is pgx's documented idiom.
func rowsIdiom(ctx context.Context, tx pgx.Tx) {
	rows, _ := tx.Query(ctx, "select 1")
	rows.Close()
	_, _ = tx.Query(ctx, "select 1") // want `error of Query on the transaction is dropped`
}
