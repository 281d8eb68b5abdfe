package idem_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
)

// A handler that never touches idle_in_transaction_session_timeout, under
// the runtime's own (small) IdleInTransactionTimeout, whose session the
// server ends with 25P03 only because the network held its answers (a
// stall of the replies longer than the timeout, or a round trip slower
// than it) is an outage, on every try: the idle stretch that timed out
// began at the server's answer to the handler's previous statement (or to
// the runtime's BEGIN), and the client's window from sending that
// statement to reading the FATAL is at least the runtime's timeout.
//
// The FATAL is read inside tx.QueryRow (pgconn reads up to the row
// description) but reported by Row.Scan (and inside tx.Query, reported by
// Rows.Next/Close; inside SendBatch, by its results). The window must
// start before the call that read it, not at the Scan's busy stretch
// before, or the window is one round trip long, "shorter than the
// runtime's timeout", the timeout deemed lowered by the handler, and the
// outage charged on the third try in a row.
func TestOutageEndedAtQueryRowIsNoAttempt(t *testing.T) {
	t.Parallel()
	scan := func(ctx context.Context, tx pgx.Tx) error {
		var one int
		return tx.QueryRow(ctx, `SELECT 1`).Scan(&one)
	}
	rows := func(ctx context.Context, tx pgx.Tx) error {
		r, err := tx.Query(ctx, `SELECT 1`)
		if err != nil {
			return err
		}
		_, err = pgx.CollectRows(r, pgx.RowTo[int32])
		return err
	}
	batch := func(ctx context.Context, tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue(`SELECT 1`)
		return tx.SendBatch(ctx, b).Close()
	}
	for name, query := range map[string]func(ctx context.Context, tx pgx.Tx) error{
		"QueryRow.Scan":   scan,
		"Query.Next":      rows,
		"SendBatch.Close": batch,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			direct, proxied, px := proxiedConsumeDB(t, nil)
			logs := &lockedBuffer{}
			p := processorWith(t, idem.NewStore(proxied), idem.ProcessorConfig{
				Retry:                    idem.RetryPolicy{MaxAttempts: 1},
				Outage:                   idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
				IdleInTransactionTimeout: 200 * time.Millisecond,
				StorageTimeout:           5 * time.Second,
				Logger:                   slog.New(slog.NewTextHandler(logs, nil)),
			})
			// A network 150ms each way: the handler's first statement
			// arrives 300ms after the answer to the runtime's BEGIN left
			// the server, which ends the session 200ms after that answer.
			// The handler's 20ms of work before it is no idling that
			// matters (the runtime's rule charges 200ms).
			const faulty = 4 // tries the slow network spoils; the next one is on a fast one
			px.Latency(150 * time.Millisecond)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				if calls.Add(1) > faulty {
					px.Latency(0)
				}
				time.Sleep(20 * time.Millisecond)
				if err := query(ctx, tx); err != nil {
					return err
				}
				return insertEffect(ctx, tx, e)
			})
			o, err := processWithin(p, &h, idleRecord("stalled"), 40*time.Second)
			if err != nil || o != idem.Applied {
				t.Fatalf("Process: %v, %v after %d calls; want applied once the network is back (last log lines:\n%s)", o, err, calls.Load(), tail(logs.String(), 4))
			}
			if got := strings.Count(logs.String(), "25P03"); got < faulty {
				t.Fatalf("%d tries ended with 25P03, want %d: the test tests nothing; logs:\n%s", got, faulty, logs)
			}
			wantAppliedOnce(t, direct)
		})
	}
}

// The other side of TestOutageEndedAtQueryRowIsNoAttempt: a handler that
// lowers its timeout and idles past it, whose next statement is a
// QueryRow (the FATAL read inside it, reported by Scan), idled most of
// the window: charged at once, not after two tries waited out as unclear.
func TestLoweredIdleTimeoutEndedAtQueryRowIsChargedAtOnce(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	logs := &lockedBuffer{}
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		StorageTimeout: 2 * time.Second,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
	})
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
			return err
		}
		time.Sleep(300 * time.Millisecond)
		var one int
		return tx.QueryRow(ctx, `SELECT 1`).Scan(&one)
	})
	o, err := processWithin(p, &h, idleRecord("lowered-queryrow"), 15*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v after %d calls; want dead-lettered (logs:\n%s)", o, err, calls.Load(), logs)
	}
	if n := calls.Load(); n != 1 || strings.Contains(logs.String(), "storage unavailable") {
		t.Fatalf("the handler ran %d times, want 1, charged at once; logs:\n%s", n, logs)
	}
	if _, last := lastDeadLetter(t, pool); !strings.Contains(last, "held its transaction idle for") {
		t.Fatalf("dead letter %q, want the handler's idling named", last)
	}
}
