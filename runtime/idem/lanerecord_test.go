package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// gid is the id of the goroutine it runs on ("goroutine N [running]:").
func gid() string {
	b := make([]byte, 64)
	return strings.Fields(string(b[:runtime.Stack(b, false)]))[1]
}

// batchGoroutines is a pgx tracer that notes the goroutine every batch
// (the runtime's pipelines: BEGIN with the processed-event insert, the
// checked COMMIT) is sent from.
type batchGoroutines struct {
	mu  sync.Mutex
	ids map[string]int
}

func (b *batchGoroutines) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (b *batchGoroutines) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (b *batchGoroutines) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ids[gid()]++
	return ctx
}
func (b *batchGoroutines) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (b *batchGoroutines) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// With the Kafka consumer's lane, a record is one hand-off: its decoding,
// the runtime's statements and its handler all run on the lane's worker,
// not each user call on the worker and the runtime's statements on the
// caller's goroutine (two hand-offs per record, a quarter of the
// consumer's CPU per record). Fails on the version before: the pipelines
// ran on the caller's goroutine.
func TestLaneRecordIsOneHandOff(t *testing.T) {
	t.Parallel()
	tr := &batchGoroutines{ids: map[string]int{}}
	_, store := tracedConsumeDB(t, tr)
	p := processor(t, store, 3)
	var decodedOn, handledOn []string
	h := goroutineNoting(&decodedOn, &handledOn)
	lane, stop := guardlane.With(context.Background())
	defer stop()
	tr.mu.Lock()
	clear(tr.ids) // Migrate's and the table's statements
	tr.mu.Unlock()
	caller := gid()
	for i, id := range []string{"one-1", "one-2"} {
		rec := &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(`{"id":"` + id + `","amount":1}`)}
		if o, err := p.Process(lane, &h, rec); err != nil || o != idem.Applied {
			t.Fatalf("%s: %v, %v", id, o, err)
		}
	}
	worker := handledOn[0]
	if worker == caller {
		t.Fatalf("the handler ran on the caller's goroutine %s", caller)
	}
	for _, g := range append(decodedOn, handledOn...) {
		if g != worker {
			t.Fatalf("user code ran on goroutines %v (decode) and %v (handler), want all on the worker %s", decodedOn, handledOn, worker)
		}
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.ids) != 1 || tr.ids[worker] != 4 {
		t.Fatalf("the runtime's pipelines ran on goroutines %v, want 4 on the worker %s (the caller is %s)", tr.ids, worker, caller)
	}
}

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
		h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			calls.Add(1)
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			runtime.Goexit()
			return nil
		})
		lane, stop := guardlane.With(context.Background())
		defer stop()
		rec := &idem.Record{Topic: "events", Offset: 9, Value: []byte(`{"id":"gx-always","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, rec); o != idem.DeadLettered {
			t.Fatalf("outcome %v, want dead-lettered", o)
		}
		if calls.Load() != 3 {
			t.Fatalf("handler ran %d times, want the budget of 3", calls.Load())
		}
		dl, err := store.DeadLetter(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
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
		}, func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
		lane, stop := guardlane.With(context.Background())
		defer stop()
		rec := &idem.Record{Topic: "events", Offset: 3, Value: []byte(`{"id":"gx-d","amount":5}`)}
		if o := laneProcess(t, p, lane, &h, rec); o != idem.DeadLettered {
			t.Fatalf("outcome %v, want dead-lettered", o)
		}
		if decodes.Load() != 1 || calls.Load() != 0 {
			t.Fatalf("decoded %d times, handler ran %d times; want 1 and 0", decodes.Load(), calls.Load())
		}
		dl, err := store.DeadLetter(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
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
		if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed_events) + (SELECT count(*) FROM idem_dead_letters)`); n != 0 {
			t.Fatalf("%d rows written, want 0", n)
		}
	})
}

// laneProcess is processBounded with the lane's context, as the Kafka
// consumer's partition loop calls Process.
func laneProcess(t *testing.T, p *idem.Processor, lane context.Context, h *idem.EventHandler, rec *idem.Record) idem.Outcome {
	t.Helper()
	return processBoundedIn(t, lane, p, h, rec)
}

// goroutineNoting is the test handler, its decoding noting the goroutine
// it runs on in decoded and its handler in handled.
func goroutineNoting(decoded, handled *[]string) idem.EventHandler {
	return idem.Consume(idem.EventSpec[event]{
		Topic: "events", Context: "ctx",
		EventID: func(e event) string { return *e.ID },
		Decode: func(b []byte) (e event, err error) {
			*decoded = append(*decoded, gid())
			return e, json.Unmarshal(b, &e)
		},
	}, func(ctx context.Context, tx pgx.Tx, e event) error {
		*handled = append(*handled, gid())
		return insertEffect(ctx, tx, e)
	})
}

// A batch on the lane is one hand-off too: every record's decoding and
// handler, and the batch's pipelines, on the lane's worker. Fails on the
// version before: the pipelines ran on the caller's goroutine, and each
// user call was handed to the worker on its own.
func TestLaneBatchIsOneHandOff(t *testing.T) {
	t.Parallel()
	tr := &batchGoroutines{ids: map[string]int{}}
	pool, store := tracedConsumeDB(t, tr)
	p := processor(t, store, 3)
	var on []string
	h := goroutineNoting(&on, &on)
	lane, stop := guardlane.With(context.Background())
	defer stop()
	tr.mu.Lock()
	clear(tr.ids)
	tr.mu.Unlock()
	ctx, cancel := context.WithTimeout(lane, 20*time.Second)
	defer cancel()
	outcomes, err := p.ProcessBatch(ctx, &h, batchRecords("ob", 5))
	if err != nil || len(outcomes) != 5 {
		t.Fatalf("%v, %v", outcomes, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 5 {
		t.Fatalf("%d effects, want 5", n)
	}
	worker := on[0]
	if worker == gid() {
		t.Fatal("user code ran on the caller's goroutine")
	}
	for _, g := range on {
		if g != worker {
			t.Fatalf("user code ran on goroutines %v, want all on one worker", on)
		}
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.ids) != 1 || tr.ids[worker] != 2 {
		t.Fatalf("the batch's pipelines ran on goroutines %v, want 2 on the worker %s", tr.ids, worker)
	}
}

// batchRecords is n records of one partition with ids prefix-0..n-1.
func batchRecords(prefix string, n int) []*idem.Record {
	recs := make([]*idem.Record, n)
	for i := range recs {
		recs[i] = &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(`{"id":"` + prefix + `-` + string(rune('0'+i)) + `","amount":1}`)}
	}
	return recs
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
		ctx, cancel := context.WithTimeout(lane, 20*time.Second)
		defer cancel()
		outcomes, err := p.ProcessBatch(ctx, &h, batchRecords("bg", 5))
		if err != nil {
			t.Fatal(err)
		}
		want := []idem.Outcome{idem.Applied, idem.Applied, idem.DeadLettered, idem.Applied, idem.Applied}
		if !slices.Equal(outcomes, want) {
			t.Fatalf("outcomes %v, want %v", outcomes, want)
		}
		if calls.Load() != 2 {
			t.Fatalf("bg-2's handler ran %d times, want 2 (the batch's and one more of a budget of 2)", calls.Load())
		}
		dl, err := store.DeadLetter(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
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
		h := idem.Consume(idem.EventSpec[event]{
			Topic: "events", Context: "ctx",
			EventID: func(e event) string { return *e.ID },
			Decode: func(b []byte) (e event, err error) {
				if err := json.Unmarshal(b, &e); err != nil {
					return e, err
				}
				if *e.ID == "bd-3" {
					runtime.Goexit()
				}
				return e, nil
			},
		}, insertEffect)
		lane, stop := guardlane.With(context.Background())
		defer stop()
		ctx, cancel := context.WithTimeout(lane, 20*time.Second)
		defer cancel()
		outcomes, err := p.ProcessBatch(ctx, &h, batchRecords("bd", 5))
		if err != nil {
			t.Fatal(err)
		}
		want := []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.DeadLettered, idem.Applied}
		if !slices.Equal(outcomes, want) {
			t.Fatalf("outcomes %v, want %v", outcomes, want)
		}
		dl, err := store.DeadLetter(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
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
type exitingTracer struct{ exits atomic.Int64 }

func (e *exitingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (e *exitingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (e *exitingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	if e.exits.Add(-1) >= 0 {
		runtime.Goexit()
	}
	return ctx
}
func (e *exitingTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (e *exitingTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

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
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
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
				dl, err := store.DeadLetter(context.Background(), 1)
				if err != nil {
					t.Fatal(err)
				}
				if want := "panic in the consumer's hooks (a logger, meter or tracer) while applying the record: called runtime.Goexit"; dl.Attempts != 3 || dl.LastError != want {
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

// exitingLog is a slog.Handler, the application's, that ends the goroutine
// it runs on at every record of level error and above.
type exitingLog struct{ exits *atomic.Int64 }

func (e exitingLog) Enabled(context.Context, slog.Level) bool { return true }
func (e exitingLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		e.exits.Add(1)
		runtime.Goexit()
	}
	return nil
}
func (e exitingLog) WithAttrs([]slog.Attr) slog.Handler { return e }
func (e exitingLog) WithGroup(string) slog.Handler      { return e }

// A logger that ends the worker on the dead letter's own path (its "dead-
// lettering record" line) keeps the record from ever being dead-lettered;
// the record then waits, retried with the backoff, until its context ends —
// never in a hot loop. Fails on the first version of the lane, which
// resumed at once: over a hundred thousand restarts a second.
func TestLaneGoexitInDeadLetterPathIsBounded(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	var exits atomic.Int64
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1, Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Logger: slog.New(exitingLog{exits: &exits}),
	})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(func(context.Context, pgx.Tx, event) error { return errors.New("refused") })
	lane, stop := guardlane.With(context.Background())
	defer stop()
	ctx, cancel := context.WithTimeout(lane, 500*time.Millisecond)
	defer cancel()
	_, err = p.Process(ctx, &h, &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"id":"dl-hook"}`)})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Process: %v, want the context's deadline", err)
	}
	// 500 ms of backoffs of 10–20 ms: a few dozen restarts.
	if n := exits.Load(); n < 2 || n > 100 {
		t.Fatalf("%d restarts in 500 ms, want a few dozen at most", n)
	}
	if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_dead_letters) + (SELECT count(*) FROM idem_processed_events)`); n != 0 {
		t.Fatalf("%d rows written", n)
	}
}
