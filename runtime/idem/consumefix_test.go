package idem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review of issue 8 (consumer side): failures the handler causes on
// its own transaction, and errors that look like cancellation, are the
// record's failures. They must use its retry budget and end as a dead letter
// while the database is healthy, never be waited out as an outage forever.

// processWithin runs Process bounded by d, returning its outcome and error
// (a processor that waits forever returns the deadline).
func processWithin(p *idem.Processor, h *idem.EventHandler, rec *idem.Record, d time.Duration) (idem.Outcome, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return p.Process(ctx, h, rec)
}

// A handler that swallows a SQL error returns nil on an aborted transaction:
// COMMIT answers ROLLBACK (pgx.ErrTxCommitRollback). Likewise a deferred
// constraint violated by the handler's writes fails at COMMIT (23505), and a
// handler that rolls the transaction back itself leaves nothing to commit
// (pgx.ErrTxClosed). The database is healthy in all three: each is the
// record's failure, used to be treated as an outage and retried forever.
func TestCommitRefusedByHandlerWritesIsRecordFailure(t *testing.T) {
	t.Parallel()
	cases := map[string]func(ctx context.Context, tx pgx.Tx, e event) error{
		"swallowed error": func(ctx context.Context, tx pgx.Tx, e event) error {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		},
		"deferred constraint": func(ctx context.Context, tx pgx.Tx, e event) error {
			_, err := tx.Exec(ctx, `INSERT INTO deferred_effects (event_id) VALUES ($1), ($1)`, *e.ID)
			return err
		},
		"handler rolled back": func(ctx context.Context, tx pgx.Tx, e event) error {
			return tx.Rollback(ctx)
		},
	}
	for name, fn := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			pgtest.Exec(t, pool, `CREATE TABLE deferred_effects (event_id text, UNIQUE (event_id) DEFERRABLE INITIALLY DEFERRED)`)
			p := processor(t, store, 2)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				return fn(ctx, tx, e)
			})
			o, err := processWithin(p, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"c1","amount":1}`)}, 20*time.Second)
			if err != nil || o != idem.DeadLettered {
				t.Fatalf("Process = %v, %v after %d handler calls; want dead-lettered after the budget of 2", o, err, calls.Load())
			}
			if calls.Load() != 2 {
				t.Fatalf("handler ran %d times, want the budget of 2", calls.Load())
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 0 {
				t.Fatalf("%d processed events for a dead letter", n)
			}
		})
	}
}

// The same in batch mode: the batch falls back to records one by one, and
// only the record whose writes break the commit is dead-lettered.
func TestBatchCommitRefusedDeadLettersOnlyTheCulprit(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	pgtest.Exec(t, pool, `CREATE TABLE deferred_effects (event_id text, UNIQUE (event_id) DEFERRABLE INITIALLY DEFERRED)`)
	p := processor(t, store, 2)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		n := 1
		if e.Amount < 0 {
			n = 2 // violates the deferred unique constraint at COMMIT
		}
		for range n {
			if _, err := tx.Exec(ctx, `INSERT INTO deferred_effects (event_id) VALUES ($1)`, *e.ID); err != nil {
				return err
			}
		}
		return nil
	})
	var recs []*idem.Record
	for i := range 5 {
		amount := 1
		if i == 2 {
			amount = -1
		}
		recs = append(recs, &idem.Record{Topic: "events", Offset: int64(i), Value: fmt.Appendf(nil, `{"id":"b%d","amount":%d}`, i, amount)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	outs, err := p.ProcessBatch(ctx, &h, recs)
	if err != nil {
		t.Fatalf("ProcessBatch: %v (outcomes %v)", err, outs)
	}
	want := []idem.Outcome{idem.Applied, idem.Applied, idem.DeadLettered, idem.Applied, idem.Applied}
	for i := range want {
		if outs[i] != want[i] {
			t.Fatalf("outcomes %v, want %v", outs, want)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM deferred_effects`); n != 4 {
		t.Fatalf("%d effects, want 4", n)
	}
}

// A handler error that wraps context.Canceled (or DeadlineExceeded) while
// the processor's context is alive is the handler's own cancellation, not a
// shutdown and not an outage: budget, then dead letter. Two shapes: a plain
// wrapped error, and a query on a context the handler had cancelled (pgconn
// reports that one as "safe to retry", since nothing was sent).
func TestHandlerOwnCancellationIsRecordFailure(t *testing.T) {
	t.Parallel()
	cases := map[string]func(ctx context.Context, tx pgx.Tx, e event) error{
		"wrapped canceled": func(context.Context, pgx.Tx, event) error {
			return fmt.Errorf("call pricing: %w", context.Canceled)
		},
		"wrapped deadline": func(context.Context, pgx.Tx, event) error {
			return fmt.Errorf("call pricing: %w", context.DeadlineExceeded)
		},
		"query on cancelled context": func(ctx context.Context, tx pgx.Tx, e event) error {
			qctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := tx.Exec(qctx, `SELECT 1`)
			return err
		},
	}
	for name, fn := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				return fn(ctx, tx, e)
			})
			o, err := processWithin(p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"x1","amount":1}`)}, 20*time.Second)
			if err != nil || o != idem.DeadLettered || calls.Load() != 3 {
				t.Fatalf("Process = %v, %v after %d calls; want dead-lettered after the budget of 3", o, err, calls.Load())
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE attempts = 3`); n != 1 {
				t.Fatalf("%d dead letters", n)
			}
		})
	}
}

// Panics with values that are not errors, and panic(nil): recovered,
// budget, dead letter, the next record applied.
func TestOddPanicsAreDeadLettered(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 2)
	values := []any{nil, 42, struct{ A []byte }{[]byte("\x00\xff")}, fmt.Errorf("wrapped: %w", context.Canceled)}
	for i, v := range values {
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			if e.Amount < 0 {
				panic(v)
			}
			return insertEffect(ctx, tx, e)
		})
		rec := &idem.Record{Topic: "events", Offset: int64(2 * i), Value: fmt.Appendf(nil, `{"id":"p%d","amount":-1}`, i)}
		if o, err := processWithin(p, &h, rec, 20*time.Second); err != nil || o != idem.DeadLettered {
			t.Fatalf("panic(%#v): %v, %v", v, o, err)
		}
		rec = &idem.Record{Topic: "events", Offset: int64(2*i + 1), Value: fmt.Appendf(nil, `{"id":"ok%d","amount":1}`, i)}
		if o, err := processWithin(p, &h, rec, 20*time.Second); err != nil || o != idem.Applied {
			t.Fatalf("after panic(%#v): %v, %v", v, o, err)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE attempts = 2 AND last_error LIKE 'panic in handler:%'`); n != int64(len(values)) {
		t.Fatalf("%d panic dead letters, want %d", n, len(values))
	}
}

// Replaying one dead letter from several goroutines at once applies it
// exactly once; every other replay reports ErrDeadLetterReplayed.
func TestReplayDeadLetterConcurrently(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 1)
	var broken atomic.Bool
	broken.Store(true)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if broken.Load() {
			return errors.New("down")
		}
		time.Sleep(20 * time.Millisecond) // widen the window for the race
		return insertEffect(ctx, tx, e)
	})
	processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"cc","amount":1}`)})
	broken.Store(false)
	var (
		wg               sync.WaitGroup
		applied, already atomic.Int64
	)
	for range 8 {
		wg.Go(func() {
			o, err := p.ReplayDeadLetter(context.Background(), &h, 1)
			switch {
			case err == nil && o == idem.Applied:
				applied.Add(1)
			case errors.Is(err, idem.ErrDeadLetterReplayed):
				already.Add(1)
			default:
				t.Errorf("replay: %v, %v", o, err)
			}
		})
	}
	wg.Wait()
	if applied.Load() != 1 || already.Load() != 7 || pgtest.Count(t, pool, `SELECT count(*) FROM effects`) != 1 {
		t.Fatalf("applied %d, already %d, effects %d; want 1, 7, 1", applied.Load(), already.Load(), pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
	}
}

// A dead letter whose event was meanwhile applied (the producer sent the
// event again and it went through) replays as a duplicate: no second
// effect, and the dead letter is marked replayed.
func TestReplayOfAppliedEventIsDuplicate(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 1)
	var broken atomic.Bool
	broken.Store(true)
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if broken.Load() {
			return errors.New("down")
		}
		return insertEffect(ctx, tx, e)
	})
	processBounded(t, p, &h, &idem.Record{Topic: "events", Offset: 0, Value: []byte(`{"id":"d1","amount":1}`)})
	broken.Store(false)
	if o := processBounded(t, p, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"d1","amount":1}`)}); o != idem.Applied {
		t.Fatalf("resend: %v", o)
	}
	if o, err := p.ReplayDeadLetter(context.Background(), &h, 1); err != nil || o != idem.Duplicate {
		t.Fatalf("replay: %v, %v; want duplicate", o, err)
	}
	dl, err := store.DeadLetter(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if dl.ReplayedAt.IsZero() || pgtest.Count(t, pool, `SELECT count(*) FROM effects`) != 1 {
		t.Fatalf("replayed_at %v, effects %d", dl.ReplayedAt, pgtest.Count(t, pool, `SELECT count(*) FROM effects`))
	}
}

// A handler that fails with a serialization failure forever is waited out
// (by design: it is the database's failure) but with backoff, logged at
// every try, never in a hot loop.
func TestEndlessSerializationFailureBacksOff(t *testing.T) {
	t.Parallel()
	_, store := consumeDB(t)
	var logs lockedBuffer
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1},
		Outage: idem.Backoff{Initial: 10 * time.Millisecond, Max: 200 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := handler(func(context.Context, pgx.Tx, event) error {
		calls.Add(1)
		return &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	})
	o, err := processWithin(p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"s","amount":1}`)}, 1500*time.Millisecond)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Process = %v, %v; want it still waiting when its context ends", o, err)
	}
	// 1.5 s of backoff from 10 ms doubling to 200 ms is about a dozen tries;
	// a hot loop makes thousands.
	if n := calls.Load(); n < 3 || n > 60 {
		t.Fatalf("handler ran %d times in 1.5 s", n)
	}
	if n := int64(strings.Count(logs.String(), "storage unavailable; waiting, no attempt used")); n < calls.Load()-1 {
		t.Fatalf("%d log lines for %d tries: the wait is not observable", n, calls.Load())
	}
}

// lockedBuffer is a bytes.Buffer safe for a logger and a reader.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// In batch mode a failing handler ran once more than its budget (the failed
// batch attempt, then MaxAttempts one by one), against RetryPolicy's
// "MaxAttempts is how many times the handler runs". The batch run counts.
func TestBatchHandlerFailureUsesTheBudget(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 2)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if e.Amount < 0 {
			calls.Add(1)
			return errors.New("refused")
		}
		return insertEffect(ctx, tx, e)
	})
	recs := []*idem.Record{
		{Topic: "events", Offset: 0, Value: []byte(`{"id":"f0","amount":1}`)},
		{Topic: "events", Offset: 1, Value: []byte(`{"id":"f1","amount":-1}`)},
		{Topic: "events", Offset: 2, Value: []byte(`{"id":"f2","amount":1}`)},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	outs, err := p.ProcessBatch(ctx, &h, recs)
	if err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 2 || fmt.Sprint(outs) != "[applied dead-lettered applied]" {
		t.Fatalf("failing handler ran %d times with MaxAttempts 2 in batch mode (want 2), outcomes %v", calls.Load(), outs)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE attempts = 2 AND koffset = 1`); n != 1 {
		t.Fatalf("dead letter with attempts 2: %d", n)
	}
	// A budget of one: the batch run was the only one.
	p1 := processor(t, store, 1)
	calls.Store(0)
	recs[1] = &idem.Record{Topic: "events", Offset: 3, Value: []byte(`{"id":"f3","amount":-1}`)}
	recs[0] = &idem.Record{Topic: "events", Offset: 4, Value: []byte(`{"id":"f4","amount":1}`)}
	recs[2] = &idem.Record{Topic: "events", Offset: 5, Value: []byte(`{"id":"f5","amount":1}`)}
	if _, err := p1.ProcessBatch(ctx, &h, recs); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 1 {
		t.Fatalf("failing handler ran %d times with MaxAttempts 1 in batch mode", calls.Load())
	}
}
