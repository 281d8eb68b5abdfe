// Service-shaped cancellation handling found by review (vetfix): each
// EXPECT is a finding, each NOEXPECT a pattern that must stay silent.
package swallowcancelservice

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"
)

func work(ctx context.Context) error { return nil }

// C1 NOEXPECT: no tx.
func c1(ctx context.Context) error {
	if err := work(ctx); errors.Is(err, context.Canceled) {
		return nil
	}
	return nil
}

// C2 NOEXPECT: worker loop, graceful shutdown, tx per message in another case.
func c2(ctx context.Context, pool *pgxpool.Pool, in <-chan string) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case s := <-in:
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, s); err != nil {
				tx.Rollback(ctx)
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
		}
	}
}

// C3 EXPECT: select ctx.Done return nil in a tx function.
func c3(ctx context.Context, tx pgx.Tx, in <-chan string) error {
	select {
	case <-ctx.Done(): // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	case s := <-in:
		_, err := tx.Exec(ctx, s)
		return err
	}
}

// C4 EXPECT: ctx.Err() continue.
func c4(ctx context.Context, tx pgx.Tx, items []string) error {
	for _, it := range items {
		if ctx.Err() != nil { // want `cancellation is swallowed inside a transaction \(the branch continues\)`
			continue
		}
		if _, err := tx.Exec(ctx, it); err != nil {
			return err
		}
	}
	return nil
}

// C5 EXPECT: errgroup wait, canceled swallowed.
func c5(ctx context.Context, tx pgx.Tx) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return work(gctx) })
	if err := g.Wait(); err != nil && errors.Is(err, context.Canceled) { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	}
	_, err := tx.Exec(ctx, "insert")
	return err
}

// C6 EXPECT: errgroup goroutine in a tx function swallows cancel in closure that uses tx.
func c6(ctx context.Context, tx pgx.Tx) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if _, err := tx.Exec(gctx, "insert"); err != nil {
			if errors.Is(err, context.Canceled) { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
				return nil
			}
			return err
		}
		return nil
	})
	return g.Wait()
}

// C7 EXPECT: cancellation falls through: only non-cancel errors returned.
func c7(ctx context.Context, tx pgx.Tx) error {
	if err := work(ctx); err != nil {
		if !errors.Is(err, context.Canceled) { // want `cancellation is swallowed inside a transaction \(only other errors are returned; the cancellation falls through to a nil return\)`
			return err
		}
		return nil
	}
	_, err := tx.Exec(ctx, "insert")
	return err
}

// C8 EXPECT: switch.
func c8(ctx context.Context, tx pgx.Tx) error {
	err := work(ctx)
	switch {
	case errors.Is(err, context.Canceled): // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	case err != nil:
		return err
	}
	_, err = tx.Exec(ctx, "insert")
	return err
}

// C9 EXPECT: if err := ctx.Err(); err != nil { return nil }.
func c9(ctx context.Context, tx pgx.Tx) error {
	if err := ctx.Err(); err != nil { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	}
	_, err := tx.Exec(ctx, "insert")
	return err
}

// C10 EXPECT: tx.QueryRow(...).Scan dropped.
func c10(ctx context.Context, tx pgx.Tx) error {
	var id int
	tx.QueryRow(ctx, "insert returning id").Scan(&id) // want `error of QueryRow\(...\).Scan on the transaction is dropped`
	return nil
}

// C11 NOEXPECT: tx in a BeginFunc closure, outer run loop returns nil on shutdown.
func c11(ctx context.Context, pool *pgxpool.Pool, in <-chan string) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case s := <-in:
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, s)
				return err
			}); err != nil {
				return err
			}
		}
	}
}

// C12 NOEXPECT: tx committed, then a best-effort notify whose cancellation is fine.
func c12(ctx context.Context, pool *pgxpool.Pool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "insert"); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	if err := work(ctx); errors.Is(err, context.Canceled) {
		return nil
	}
	return nil
}

// C13 EXPECT: switch on the error value.
func c13(ctx context.Context, tx pgx.Tx) error {
	switch err := work(ctx); err {
	case context.DeadlineExceeded: // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	case nil:
	default:
		return err
	}
	_, err := tx.Exec(ctx, "insert")
	return err
}

// C14 EXPECT: the rollback is conditional, so the transaction may still be
// open at the branch.
func c14(ctx context.Context, pool *pgxpool.Pool, bad bool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	if bad {
		tx.Rollback(ctx)
	}
	if ctx.Err() != nil { // want `cancellation is swallowed inside a transaction \(the branch returns a nil error\)`
		return nil
	}
	return tx.Commit(ctx)
}

// C15 NOEXPECT: the negated test falls through to a return of the error.
func c15(ctx context.Context, tx pgx.Tx) error {
	if err := work(ctx); err != nil {
		if !errors.Is(err, context.Canceled) {
			return err
		}
		return err
	}
	return nil
}
