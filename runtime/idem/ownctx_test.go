package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// ownCtxStatement runs a statement that outlives ctxFor's context: a
// deadline of 50ms, or a cancel 50ms in. With pgx's default context
// watcher (pgconn.DeadlineContextWatcherHandler) the context ending in
// mid-statement closes the connection.
func ownCtxStatement(ctx context.Context, tx pgx.Tx, cancelled bool) error {
	var qctx context.Context
	var cancel context.CancelFunc
	if cancelled {
		qctx, cancel = context.WithCancel(ctx)
		time.AfterFunc(50*time.Millisecond, cancel)
	} else {
		qctx, cancel = context.WithTimeout(ctx, 50*time.Millisecond)
	}
	defer cancel()
	_, err := tx.Exec(qctx, `SELECT pg_sleep(1)`)
	return err
}

// ownCtxHandlers are handlers whose statement the handler's own context
// ends, as they report it: the error as is, the error wrapped without its
// chain (%v), or swallowed (nil returned on the closed connection).
var ownCtxHandlers = map[string]func(ctx context.Context, tx pgx.Tx) error{
	"deadline": func(ctx context.Context, tx pgx.Tx) error {
		return ownCtxStatement(ctx, tx, false)
	},
	"cancel": func(ctx context.Context, tx pgx.Tx) error {
		return ownCtxStatement(ctx, tx, true)
	},
	"deadline, chain lost": func(ctx context.Context, tx pgx.Tx) error {
		if err := ownCtxStatement(ctx, tx, false); err != nil {
			return fmt.Errorf("slow query: %v", err)
		}
		return nil
	},
	"deadline, error swallowed": func(ctx context.Context, tx pgx.Tx) error {
		_ = ownCtxStatement(ctx, tx, false) //idemvet:ignore swallowcancel the mistake this test makes on purpose
		return nil
	},
}

// A handler whose own context (a deadline it set on a statement, or a
// cancel of its own) ends its statement: pgconn's default context watcher
// closes the connection, and a closed connection under a handler was taken
// for the database going away, an outage waited out forever without using
// an attempt. The database answers: it is the record's failure, which
// recurs on every attempt, uses the budget and ends as a dead letter
// saying what happened.
func TestHandlerOwnContextClosingConnIsDeadLettered(t *testing.T) {
	t.Parallel()
	for name, fn := range ownCtxHandlers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			p := processorWith(t, store, idem.ProcessorConfig{
				Retry:          idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
				StorageTimeout: 2 * time.Second,
			})
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				return fn(ctx, tx)
			})
			o, err := processWithin(p, &h, idleRecord("own-ctx"), 5*time.Second)
			if err != nil || o != idem.DeadLettered {
				t.Fatalf("Process: %v, %v after %d calls; want dead-lettered after the budget of 3", o, err, calls.Load())
			}
			if n := calls.Load(); n != 3 {
				t.Fatalf("the handler ran %d times, want the budget of 3", n)
			}
			attempts, last := lastDeadLetter(t, pool)
			if attempts != 3 || !strings.Contains(last, "the handler's own context") {
				t.Fatalf("dead letter: %d attempts, last error %q; want 3 and the handler's own context named", attempts, last)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
				t.Fatalf("%d effects, want 0", n)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 0 {
				t.Fatalf("%d processed events, want 0", n)
			}
		})
	}
}

// The same in batch mode: the batch falls back record by record (no record
// charged), and there only the record whose handler's context ends its
// statement is charged and dead-lettered; the others are applied.
func TestBatchHandlerOwnContextDeadLettersOnlyTheCulprit(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		StorageTimeout: 2 * time.Second,
	})
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if e.Amount < 0 {
			return ownCtxStatement(ctx, tx, false)
		}
		return nil
	})
	var recs []*idem.Record
	for i := range 4 {
		amount := 1
		if i == 1 {
			amount = -1
		}
		recs = append(recs, &idem.Record{Topic: "events", Offset: int64(i), Value: fmt.Appendf(nil, `{"id":"b%d","amount":%d}`, i, amount)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	outs, err := p.ProcessBatch(ctx, &h, recs)
	if err != nil {
		t.Fatalf("ProcessBatch: %v, %v", outs, err)
	}
	want := []idem.Outcome{idem.Applied, idem.DeadLettered, idem.Applied, idem.Applied}
	if fmt.Sprint(outs) != fmt.Sprint(want) {
		t.Fatalf("outcomes %v, want %v", outs, want)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 3 {
		t.Fatalf("%d effects, want 3", n)
	}
	attempts, last := lastDeadLetter(t, pool)
	if attempts != 2 || !strings.Contains(last, "the handler's own context") {
		t.Fatalf("dead letter: %d attempts, last error %q; want 2 and the handler's own context named", attempts, last)
	}
}

// A plain handler error, and a handler's deadline on work outside the
// database (its connection stays open), are the record's failures as
// before: the budget, then a dead letter with the handler's error.
func TestHandlerErrorWithOpenConnUnchanged(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		fn   func(ctx context.Context) error
		want string
	}{
		"plain error": {fn: func(context.Context) error { return errors.New("boom") }, want: "boom"},
		"deadline outside the database": {fn: func(ctx context.Context) error {
			dctx, cancel := context.WithTimeout(ctx, time.Millisecond)
			defer cancel()
			<-dctx.Done()
			return fmt.Errorf("downstream call: %w", dctx.Err())
		}, want: "downstream call: context deadline exceeded"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			p := processor(t, store, 2)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				return c.fn(ctx)
			})
			o, err := processWithin(p, &h, idleRecord("plain"), 5*time.Second)
			if err != nil || o != idem.DeadLettered || calls.Load() != 2 {
				t.Fatalf("Process: %v, %v after %d calls; want dead-lettered after the budget of 2", o, err, calls.Load())
			}
			attempts, last := lastDeadLetter(t, pool)
			if attempts != 2 || last != c.want {
				t.Fatalf("dead letter: %d attempts, last error %q; want 2 and %q", attempts, last, c.want)
			}
		})
	}
}
