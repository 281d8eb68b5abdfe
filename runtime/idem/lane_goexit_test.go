package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// A runtime.Goexit in user code ends the lane's worker in the middle of a
// record; the record goes on, on a new worker, exactly as guarded made it
// go on: the Goexit is a failed attempt (its writes rolled back), a decode
// Goexit is a dead letter at once, the budget ends in a dead letter that
// says what happened, and the caller's goroutine and the lane carry on.
func TestLaneRecordGoexit(t *testing.T) {
	t.Parallel()
	t.Run("handler once after writing", func(t *testing.T) {
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 3)
		var calls atomic.Int64
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				runtime.Goexit()
			}
			return nil
		})
		lane, stop := guardlane.With(context.Background())
		defer stop()
		rec := &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"gx-1","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, rec); o != idem.Applied {
			t.Fatalf("outcome %v, want applied", o)
		}
		if calls.Load() != 2 {
			t.Fatalf("handler ran %d times, want 2", calls.Load())
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'gx-1'`); n != 1 {
			t.Fatalf("%d effects, want 1 (the Goexit's write rolled back)", n)
		}
		// The lane goes on with the next record.
		next := &idem.Record{Topic: "events", Offset: 2, Value: []byte(`{"id":"gx-2","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, next); o != idem.Applied {
			t.Fatalf("next record: %v", o)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 2 {
			t.Fatalf("%d effects, want 2", n)
		}
	})
	t.Run("handler always", func(t *testing.T) {
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 3)
		var calls atomic.Int64
		h := handler(countingInsert(&calls, func(int64) { runtime.Goexit() }))
		lane, stop := guardlane.With(context.Background())
		defer stop()
		rec := &idem.Record{Topic: "events", Offset: 9, Value: []byte(`{"id":"gx-always","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, rec); o != idem.DeadLettered {
			t.Fatalf("outcome %v, want dead-lettered", o)
		}
		if calls.Load() != 3 {
			t.Fatalf("handler ran %d times, want the budget of 3", calls.Load())
		}
		dl := deadLetter(t, store, 1)
		if dl.Attempts != 3 || dl.LastError != "panic in handler: called runtime.Goexit" {
			t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
		}
		if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed_events)`); n != 0 {
			t.Fatalf("%d rows of effects and processed events, want 0", n)
		}
	})
	t.Run("decode", func(t *testing.T) {
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 3)
		var decodes, calls atomic.Int64
		h := idem.Consume(idem.EventSpec[event]{
			Topic: "events", Context: "ctx",
			EventID: func(e event) string { return *e.ID },
			Decode: func(b []byte) (e event, err error) {
				decodes.Add(1)
				runtime.Goexit()
				return e, nil
			},
		}, countingInsert(&calls, nil))
		lane, stop := guardlane.With(context.Background())
		defer stop()
		rec := &idem.Record{Topic: "events", Offset: 3, Value: []byte(`{"id":"gx-d","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, rec); o != idem.DeadLettered {
			t.Fatalf("outcome %v, want dead-lettered", o)
		}
		if decodes.Load() != 1 || calls.Load() != 0 {
			t.Fatalf("decoded %d times, handler ran %d times; want 1 and 0", decodes.Load(), calls.Load())
		}
		dl := deadLetter(t, store, 1)
		if dl.Attempts != 1 || dl.LastError != "panic in decoding the record or reading its event id: called runtime.Goexit" {
			t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 0 {
			t.Fatalf("%d processed events", n)
		}
	})
	t.Run("cancelled meanwhile", func(t *testing.T) {
		// A Goexit after the context ended: nothing is charged or
		// committed, Process answers the context's error (the record is
		// delivered again).
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 3)
		lane, stop := guardlane.With(context.Background())
		defer stop()
		ctx, cancel := context.WithCancel(lane)
		h := handler(func(hctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(hctx, tx, e); err != nil {
				return err
			}
			cancel()
			runtime.Goexit()
			return nil
		})
		rec := &idem.Record{Topic: "events", Offset: 4, Value: []byte(`{"id":"gx-c","amount":5}`)}
		done := make(chan error, 1)
		go func() { _, err := p.Process(ctx, &h, rec); done <- err }()
		select {
		case err := <-done:
			if err != context.Canceled {
				t.Fatalf("Process: %v, want context.Canceled", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("Process did not return")
		}
		if n := rowsWritten(t, pool); n != 0 {
			t.Fatalf("%d rows written, want 0", n)
		}
	})
}

// A Goexit in a batch on the lane fails the batch as a panic would: it
// falls back to record by record, the record whose handler ended the
// worker charged the attempt it used in the batch, an undecodable one dead
// at once, every other record applied once.
func TestLaneBatchGoexit(t *testing.T) {
	t.Parallel()
	t.Run("handler", func(t *testing.T) {
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 2)
		var calls atomic.Int64
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			if *e.ID == "bg-2" {
				calls.Add(1)
				runtime.Goexit()
			}
			return nil
		})
		lane, stop := guardlane.With(context.Background())
		defer stop()
		outcomes := laneProcessBatch(t, p, lane, &h, batchRecords("bg", 5))
		want := []idem.Outcome{idem.Applied, idem.Applied, idem.DeadLettered, idem.Applied, idem.Applied}
		if !slices.Equal(outcomes, want) {
			t.Fatalf("outcomes %v, want %v", outcomes, want)
		}
		if calls.Load() != 2 {
			t.Fatalf("bg-2's handler ran %d times, want 2 (the batch's and one more of a budget of 2)", calls.Load())
		}
		dl := deadLetter(t, store, 1)
		if dl.Attempts != 2 || dl.LastError != "panic in handler: called runtime.Goexit" {
			t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id <> 'bg-2'`); n != 4 {
			t.Fatalf("%d effects of the other records, want 4", n)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'bg-2'`); n != 0 {
			t.Fatalf("%d effects of bg-2, want 0", n)
		}
	})
	t.Run("decode", func(t *testing.T) {
		t.Parallel()
		pool, store := consumeDB(t)
		p := processor(t, store, 3)
		h := decodingThen(func(e event) {
			if *e.ID == "bd-3" {
				runtime.Goexit()
			}
		}, insertEffect)
		lane, stop := guardlane.With(context.Background())
		defer stop()
		outcomes := laneProcessBatch(t, p, lane, &h, batchRecords("bd", 5))
		want := []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.DeadLettered, idem.Applied}
		if !slices.Equal(outcomes, want) {
			t.Fatalf("outcomes %v, want %v", outcomes, want)
		}
		dl := deadLetter(t, store, 1)
		if dl.Attempts != 1 || dl.LastError != "panic in decoding the record or reading its event id: called runtime.Goexit" {
			t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 4 {
			t.Fatalf("%d effects, want 4", n)
		}
	})
}

// exitingTracer is a pgx tracer, the application's code, that ends the
// goroutine it runs on (runtime.Goexit) when a batch starts, while exits
// says so.
type exitingTracer struct {
	noopTracer
	exits atomic.Int64
}

func (e *exitingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	if e.exits.Add(-1) >= 0 {
		runtime.Goexit()
	}
	return ctx
}

// A Goexit outside the record's decode and handler — in a hook of the
// application's that the runtime calls while applying the record (here a
// pgx tracer) — is charged to the record after a backoff, never resumed in
// a hot loop (120,000 restarts a second on the first version of the
// lane): a hook that does it once costs one attempt, one that always does
// it ends in a dead letter that says where.
func TestLaneGoexitInHookIsBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		exits    int64
		outcome  idem.Outcome
		handlers int64
	}{
		{"once", 1, idem.Applied, 1},
		{"always", 1 << 40, idem.DeadLettered, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tr := &exitingTracer{}
			pool, store := tracedConsumeDB(t, tr)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(countingInsert(&calls, nil))
			lane, stop := guardlane.With(context.Background())
			defer stop()
			tr.exits.Store(tc.exits)
			start := time.Now()
			rec := &idem.Record{Topic: "events", Offset: 5, Value: []byte(`{"id":"hook-1","amount":1}`)}
			if o := laneProcess(t, p, lane, &h, rec); o != tc.outcome {
				t.Fatalf("outcome %v, want %v", o, tc.outcome)
			}
			tr.exits.Store(0)
			if calls.Load() != tc.handlers {
				t.Fatalf("handler ran %d times, want %d", calls.Load(), tc.handlers)
			}
			if tc.outcome == idem.DeadLettered {
				dl := deadLetter(t, store, 1)
				if dl.Attempts != 3 || dl.LastError != hookGoexit {
					t.Fatalf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
				}
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != tc.handlers {
				t.Fatalf("%d effects, want %d", n, tc.handlers)
			}
			t.Logf("done in %v", time.Since(start))
		})
	}
}

// hookGoexit is the dead letter's error of a record whose hook (not its
// decoding or handler) ended the worker on every attempt.
const hookGoexit = "panic in the consumer's hooks (a logger, meter or tracer) while applying the record: called runtime.Goexit"

// exitingLog is a slog.Handler, the application's, that ends the goroutine
// it runs on at the lines match picks, counting them in exits: at every
// one, or with once at the first only.
type exitingLog struct {
	exits *atomic.Int64
	match func(slog.Record) bool
	once  bool
}

func (e exitingLog) Enabled(context.Context, slog.Level) bool { return true }
func (e exitingLog) Handle(_ context.Context, r slog.Record) error {
	if e.match(r) {
		if n := e.exits.Add(1); !e.once || n == 1 {
			runtime.Goexit()
		}
	}
	return nil
}
func (e exitingLog) WithAttrs([]slog.Attr) slog.Handler { return e }
func (e exitingLog) WithGroup(string) slog.Handler      { return e }

// errorLines matches the lines of level error and above.
func errorLines(r slog.Record) bool { return r.Level >= slog.LevelError }

// A logger that ends the worker on the dead letter's own path (its "dead-
// lettering record" line) keeps the record from ever being dead-lettered;
// the record then waits, retried with the backoff, until its context ends —
// never in a hot loop. Fails on the first version of the lane, which
// resumed at once: over a hundred thousand restarts a second.
func TestLaneGoexitInDeadLetterPathIsBounded(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	var exits atomic.Int64
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1, Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Logger: slog.New(exitingLog{exits: &exits, match: errorLines}),
	})
	h := handler(func(context.Context, pgx.Tx, event) error { return errors.New("refused") })
	lane, stop := guardlane.With(context.Background())
	defer stop()
	ctx, cancel := context.WithTimeout(lane, 500*time.Millisecond)
	defer cancel()
	_, err := p.Process(ctx, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"dl-hook"}`)})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Process: %v, want the context's deadline", err)
	}
	// 500 ms of backoffs of 10–20 ms: a few dozen restarts.
	if n := exits.Load(); n < 2 || n > 100 {
		t.Fatalf("%d restarts in 500 ms, want a few dozen at most", n)
	}
	if n := rowsWritten(t, pool); n != 0 {
		t.Fatalf("%d rows written", n)
	}
}

// A Goexit in an application hook on the dead letter's own path (here the
// logger, once, at "dead-lettering record") must not replace the record's
// failure: the dead letter, once stored, says why the record failed (the
// handler's error, the decoding's) and how many attempts it used. Fails on
// lanerec: the dead letter said "panic in the consumer's hooks ...", the
// handler's (or decoder's) error lost.
func TestLaneGoexitInDeadLetterPathKeepsCause(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		attempts int
		value    string
		want     string
		used     int
	}{
		{"handler_budget_1", 1, `{"id":"dlc-1"}`, "refused", 1},
		{"handler_budget_3", 3, `{"id":"dlc-3"}`, "refused", 3},
		{"decode", 3, `{"id":`, "unexpected end of JSON input", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, store := consumeDB(t)
			var exits atomic.Int64
			p := processorWith(t, store, idem.ProcessorConfig{
				Retry: idem.RetryPolicy{MaxAttempts: tc.attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				Logger: slog.New(exitingLog{exits: &exits, once: true,
					match: func(r slog.Record) bool { return r.Message == "dead-lettering record" }}),
			})
			var calls atomic.Int64
			h := handler(func(context.Context, pgx.Tx, event) error { calls.Add(1); return errors.New("refused") })
			lane, stop := guardlane.With(context.Background())
			defer stop()
			o := laneProcess(t, p, lane, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(tc.value)})
			if o != idem.DeadLettered {
				t.Fatalf("outcome %v, want dead-lettered", o)
			}
			if exits.Load() < 1 {
				t.Fatal("the logger never ended the worker")
			}
			dl := deadLetter(t, store, 1)
			if dl.Attempts != tc.used || !strings.Contains(dl.LastError, tc.want) {
				t.Errorf("dead letter: attempts %d, error %q; want %d, %q", dl.Attempts, dl.LastError, tc.used, tc.want)
			}
			if tc.name != "decode" && calls.Load() != int64(tc.attempts) {
				t.Errorf("handler ran %d times, want %d", calls.Load(), tc.attempts)
			}
		})
	}
}

// commitExitTracer is a pgx tracer, the application's, that ends the
// goroutine it runs on (runtime.Goexit) in TraceBatchEnd of a batch that
// holds a COMMIT — after the server answered it: the transaction is
// committed — while exits says so.
type commitExitTracer struct {
	noopTracer
	exits   atomic.Int64
	atStart bool // in TraceBatchStart instead: before the COMMIT is sent
}

type commitBatchKey struct{}

func (e *commitExitTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if strings.EqualFold(strings.TrimSpace(q.SQL), "commit") {
			if e.atStart && e.exits.Add(-1) >= 0 {
				runtime.Goexit()
			}
			return context.WithValue(ctx, commitBatchKey{}, true)
		}
	}
	return ctx
}
func (e *commitExitTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	if !e.atStart && ctx.Value(commitBatchKey{}) != nil && d.Err == nil && e.exits.Add(-1) >= 0 {
		runtime.Goexit()
	}
}

// A Goexit in an application's hook after the record's COMMIT took effect
// (a pgx tracer's TraceBatchEnd of the commit) must not dead-letter the
// applied record: its effects are committed, its processed-event row too.
// Fails on lanerec: the Goexit outside user code was charged to the record
// as a failed attempt, and on its last attempt (here MaxAttempts 1, or the
// third of 3 after two handler failures) the record was dead-lettered
// although it was applied.
func TestLaneGoexitAfterCommitIsNotDeadLettered(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		attempts int
		fails    int64 // handler failures before it succeeds
	}{
		{"budget_1", 1, 0},
		{"last_of_3", 3, 2},
		{"first_of_3", 3, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tr := &commitExitTracer{}
			pool, store := tracedConsumeDB(t, tr)
			p := processor(t, store, tc.attempts)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				if calls.Add(1) <= tc.fails {
					return errors.New("refused")
				}
				return insertEffect(ctx, tx, e)
			})
			lane, stop := guardlane.With(context.Background())
			defer stop()
			tr.exits.Store(1)
			rec := &idem.Record{Topic: "events", Offset: 7, Value: []byte(`{"id":"after-commit","amount":1}`)}
			o := laneProcess(t, p, lane, &h, rec)
			if tr.exits.Load() == 1 {
				t.Fatal("the tracer never ended the worker after a COMMIT")
			}
			if o == idem.DeadLettered {
				t.Errorf("outcome %v: an applied record was dead-lettered", o)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
				t.Errorf("%d dead letters of an applied record, want 0", n)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
				t.Errorf("%d effects, want 1", n)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 1 {
				t.Errorf("%d processed-event rows, want 1", n)
			}
			if n := calls.Load(); n != tc.fails+1 {
				t.Errorf("handler ran %d times, want %d", n, tc.fails+1)
			}
		})
	}
}

// The same in batch mode: a Goexit after the batch's COMMIT took effect
// falls back record by record, where every record is a duplicate of the
// batch that committed: effects once, no dead letter. Passes on lanerec.
func TestLaneBatchGoexitAfterCommit(t *testing.T) {
	t.Parallel()
	tr := &commitExitTracer{}
	pool, store := tracedConsumeDB(t, tr)
	logs := newLineLog()
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Logger: slog.New(logs),
	})
	var calls atomic.Int64
	h := handler(countingInsert(&calls, nil))
	lane, stop := guardlane.With(context.Background())
	defer stop()
	tr.exits.Store(1)
	outcomes := laneProcessBatch(t, p, lane, &h, batchRecords("bc", 5))
	if tr.exits.Load() == 1 {
		t.Fatal("the tracer never ended the worker after a COMMIT")
	}
	if slices.Contains(outcomes, idem.DeadLettered) || len(outcomes) != 5 {
		t.Errorf("outcomes %v", outcomes)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Errorf("%d dead letters, want 0", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 5 {
		t.Errorf("%d effects, want 5", n)
	}
	if n := calls.Load(); n != 5 {
		t.Errorf("handlers ran %d times, want 5 (the batch's, none again)", n)
	}
	t.Logf("outcomes %v", outcomes)
	// The batch's failure is logged as what it was, not as "batch has an
	// undecodable record" (lanerec's wording, misleading).
	want := "WARN batch failed; applying its records one by one err=panic in the consumer's hooks (a logger, meter or tracer) while applying the record: called runtime.Goexit"
	if lines := logs.get(); !slices.Contains(lines, want) {
		t.Errorf("log lines %q, want %q among them", lines, want)
	}
}

// A hook that ends the worker at every COMMIT, before sending it (a
// tracer's TraceBatchStart): the record is never applied, and it still
// ends in a dead letter once its budget is spent, as any record a hook
// keeps failing (TestLaneGoexitInHookIsBounded), not retried for ever;
// and one that ends it after every COMMIT took effect (TraceBatchEnd) is
// applied once: a duplicate on its re-run, never dead-lettered.
func TestLaneGoexitAtEveryCommitIsBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		atStart bool
		outcome idem.Outcome
		calls   int64
		effects int64
	}{
		{"before", true, idem.DeadLettered, 3, 0},
		{"after", false, idem.Duplicate, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tr := &commitExitTracer{atStart: tc.atStart}
			pool, store := tracedConsumeDB(t, tr)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(countingInsert(&calls, nil))
			lane, stop := guardlane.With(context.Background())
			defer stop()
			tr.exits.Store(1 << 40)
			ctx, cancel := context.WithTimeout(lane, 5*time.Second)
			defer cancel()
			o, err := p.Process(ctx, &h, &idem.Record{Topic: "events", Offset: 3, Value: []byte(`{"id":"every-commit","amount":1}`)})
			if err != nil {
				t.Fatalf("Process: %v (exits %d, handler calls %d)", err, 1<<40-tr.exits.Load(), calls.Load())
			}
			if o != tc.outcome {
				t.Errorf("outcome %v, want %v", o, tc.outcome)
			}
			if n := calls.Load(); n != tc.calls {
				t.Errorf("handler ran %d times, want %d", n, tc.calls)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != tc.effects {
				t.Errorf("%d effects, want %d", n, tc.effects)
			}
			if tc.outcome == idem.DeadLettered {
				dl := deadLetter(t, store, 1)
				if dl.Attempts != 3 || dl.LastError != hookGoexit {
					t.Errorf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
				}
			} else if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
				t.Errorf("%d dead letters", n)
			}
		})
	}
}

// A batch on the lane whose context is cancelled in a handler (which then
// returns, panics or Goexits) or in a decoder (which then Goexits) commits
// nothing and returns the context's error, on and off the lane.
func TestLaneBatchCancelled(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"return", "panic", "Goexit", "decoder Goexit"} {
		for _, onLane := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/lane=%v", how, onLane), func(t *testing.T) {
				t.Parallel()
				pool, store := consumeDB(t)
				p := processor(t, store, 3)
				base, stop := laneIf(context.Background(), onLane)
				defer stop()
				ctx, cancel := context.WithCancel(base)
				defer cancel()
				h := decodingThen(func(e event) {
					if how == "decoder Goexit" && *e.ID == "cx-3" {
						cancel()
						runtime.Goexit()
					}
				}, func(hctx context.Context, tx pgx.Tx, e event) error {
					if err := insertEffect(hctx, tx, e); err != nil {
						return err
					}
					if *e.ID == "cx-2" {
						cancel()
						switch how {
						case "panic":
							panic("after cancel")
						case "Goexit":
							runtime.Goexit()
						}
					}
					return nil
				})
				outcomes, err := p.ProcessBatch(ctx, &h, batchRecords("cx", 5))
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("ProcessBatch: %v, %v; want context.Canceled", outcomes, err)
				}
				if len(outcomes) != 0 {
					t.Fatalf("outcomes %v, want none", outcomes)
				}
				if n := rowsWritten(t, pool); n != 0 {
					t.Fatalf("%d rows written, want 0", n)
				}
			})
		}
	}
}

// Shutdown or a rebalance during the backoff of a record resumed after a
// Goexit: Process answers the context's error at once, and nothing is
// committed (no effect, no processed event, no dead letter).
func TestLaneCancelDuringResumedBackoff(t *testing.T) {
	t.Parallel()
	for _, onLane := range []bool{false, true} {
		t.Run(fmt.Sprintf("lane=%v", onLane), func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			p := processorWith(t, store, idem.ProcessorConfig{
				Retry: idem.RetryPolicy{MaxAttempts: 2, Initial: time.Hour, Max: time.Hour},
			})
			ctx, stop := laneIf(context.Background(), onLane)
			defer stop()
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			called := make(chan struct{}, 1)
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				called <- struct{}{}
				runtime.Goexit()
				return nil
			})
			done := make(chan error, 1)
			go func() {
				_, err := p.Process(ctx, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"cb","amount":1}`)})
				done <- err
			}()
			<-called
			time.Sleep(50 * time.Millisecond) // into the hour's backoff
			cancel()
			select {
			case err := <-done:
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("Process: %v, want context.Canceled", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Process did not return after the cancellation")
			}
			if n := rowsWritten(t, pool); n != 0 {
				t.Fatalf("%d rows written, want 0", n)
			}
		})
	}
}
