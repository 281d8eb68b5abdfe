package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
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

// lineLog is a slog.Handler that keeps each line as "LEVEL msg k=v ..."
// with the attributes that say what the processor decided (attempt,
// attempts, err), not those that vary from run to run (stack, wait).
type lineLog struct {
	mu    *sync.Mutex
	lines *[]string
}

func newLineLog() lineLog { return lineLog{mu: &sync.Mutex{}, lines: &[]string{}} }

func (l lineLog) Enabled(context.Context, slog.Level) bool { return true }
func (l lineLog) Handle(_ context.Context, r slog.Record) error {
	s := r.Level.String() + " " + r.Message
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "attempt", "attempts", "err":
			s += fmt.Sprintf(" %s=%v", a.Key, a.Value)
		}
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.lines = append(*l.lines, s)
	return nil
}
func (l lineLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l lineLog) WithGroup(string) slog.Handler      { return l }
func (l lineLog) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), *l.lines...)
}

// laneRun is what became of one scenario's records: what an outsider
// sees of the processor (outcomes, handler runs, rows, dead letters, log
// lines).
type laneRun struct {
	Outcomes []string
	Calls    int64
	Effects  int64
	Dead     []string // "attempts: last error" of each dead letter
	Logs     []string
}

// laneScenario runs records through Process (or ProcessBatch when batch)
// with ctx, and reports what became of them.
func laneScenario(t *testing.T, onLane bool, attempts int, batch bool, values []string,
	mk func(calls *atomic.Int64) idem.EventHandler) laneRun {
	t.Helper()
	pool, store := consumeDB(t)
	logs := newLineLog()
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		Logger: slog.New(logs),
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := mk(&calls)
	ctx := context.Background()
	if onLane {
		lane, stop := guardlane.With(ctx)
		defer stop()
		ctx = lane
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	recs := make([]*idem.Record, len(values))
	for i, v := range values {
		recs[i] = &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(v)}
	}
	var run laneRun
	if batch {
		os, err := p.ProcessBatch(ctx, &h, recs)
		if err != nil {
			t.Fatalf("ProcessBatch: %v", err)
		}
		for _, o := range os {
			run.Outcomes = append(run.Outcomes, o.String())
		}
	} else {
		for _, rec := range recs {
			o, err := p.Process(ctx, &h, rec)
			if err != nil {
				t.Fatalf("Process(offset %d): %v", rec.Offset, err)
			}
			run.Outcomes = append(run.Outcomes, o.String())
		}
	}
	run.Calls = calls.Load()
	run.Effects = pgtest.Count(t, pool, `SELECT count(*) FROM effects`)
	rows, err := pool.Query(context.Background(), `SELECT attempts, last_error FROM idem_dead_letters ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var n int
		var e string
		if err := rows.Scan(&n, &e); err != nil {
			t.Fatal(err)
		}
		run.Dead = append(run.Dead, fmt.Sprintf("%d: %s", n, e))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	run.Logs = logs.get()
	return run
}

func (r laneRun) String() string {
	return fmt.Sprintf("outcomes %v, handler calls %d, effects %d, dead letters %q, logs:\n\t%s",
		r.Outcomes, r.Calls, r.Effects, r.Dead, strings.Join(r.Logs, "\n\t"))
}

// The Kafka consumer's lane runs a record on the lane's worker with its
// user code called inline; that must change nothing an outsider can see:
// for each kind of odd user code, a record processed with the lane ends
// exactly as one processed without it (the path that calls user code each
// on a goroutine of its own, as main did for both): same outcome, same
// number of handler runs, same rows, same dead letter (attempts and error
// text) and the same log lines.
func TestLaneMatchesOffLane(t *testing.T) {
	t.Parallel()
	rec := func(id string) string { return `{"id":"` + id + `","amount":1}` }
	insertThen := func(then func(calls int64)) func(calls *atomic.Int64) idem.EventHandler {
		return func(calls *atomic.Int64) idem.EventHandler {
			return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				n := calls.Add(1)
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				then(n)
				return nil
			})
		}
	}
	cases := []struct {
		name     string
		attempts int
		batch    bool
		values   []string
		mk       func(calls *atomic.Int64) idem.EventHandler
	}{
		{
			// A deferred call of the handler panics while Goexit unwinds
			// it, and nothing in the handler recovers that panic: the
			// guard does. Off the lane the attempt's error is that panic.
			name: "panic in a deferred call during Goexit", attempts: 2, values: []string{rec("a")},
			mk: insertThen(func(int64) {
				defer func() { panic("boom in defer") }()
				runtime.Goexit()
			}),
		},
		{
			name: "handler recovers a panic during its Goexit", attempts: 2, values: []string{rec("a")},
			mk: insertThen(func(int64) {
				defer func() { recover() }()
				defer func() { panic("boom in defer") }()
				runtime.Goexit()
			}),
		},
		{
			name: "Goexit after its own statement failed", attempts: 3, values: []string{rec("a"), rec("b")},
			mk: func(calls *atomic.Int64) idem.EventHandler {
				return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
					n := calls.Add(1)
					if _, err := tx.Exec(ctx, `SELECT 1/0`); err != nil && n == 1 {
						runtime.Goexit()
					}
					return insertEffect(ctx, tx, e) // fails: the transaction is aborted
				})
			},
		},
		{
			name: "Goexit in the EventID accessor", attempts: 3, values: []string{rec("a"), rec("b")},
			mk: func(calls *atomic.Int64) idem.EventHandler {
				return idem.Consume(idem.EventSpec[event]{
					Topic: "events", Context: "ctx",
					EventID: func(e event) string {
						if *e.ID == "a" {
							runtime.Goexit()
						}
						return *e.ID
					},
				}, func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
			},
		},
		{
			name: "Goexit on every attempt, MaxAttempts 1", attempts: 1, values: []string{rec("a"), rec("b")},
			mk: insertThen(func(int64) { runtime.Goexit() }),
		},
		{
			name: "panic(nil)", attempts: 2, values: []string{rec("a")},
			mk: insertThen(func(n int64) {
				if n == 1 {
					panic(nil)
				}
			}),
		},
		{
			name: "LockOSThread never unlocked, then Goexit", attempts: 3, values: []string{rec("a"), rec("b"), rec("c")},
			mk: insertThen(func(n int64) {
				runtime.LockOSThread()
				if n == 2 {
					runtime.Goexit()
				}
			}),
		},
		{
			// The fault setting is not left to the runtime's code or to
			// the next record: every handler starts with it off.
			name: "SetPanicOnFault left on", attempts: 3, values: []string{rec("a"), rec("b")},
			mk: insertThen(func(int64) {
				if debug.SetPanicOnFault(true) {
					panic("SetPanicOnFault was left on by an earlier call")
				}
			}),
		},
		{
			name: "batch: one handler fails, then Goexits, then applies", attempts: 4, batch: true,
			values: []string{rec("a"), rec("b"), rec("c")},
			mk: func(calls *atomic.Int64) idem.EventHandler {
				var bCalls atomic.Int64
				return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
					calls.Add(1)
					if err := insertEffect(ctx, tx, e); err != nil {
						return err
					}
					if *e.ID == "b" {
						switch bCalls.Add(1) {
						case 1:
							return errors.New("b refused")
						case 2:
							runtime.Goexit()
						}
					}
					return nil
				})
			},
		},
		{
			name: "batch: Goexit in the batch, then budget of 2", attempts: 2, batch: true,
			values: []string{rec("a"), rec("b")},
			mk:     insertThen(func(int64) { runtime.Goexit() }),
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			off := laneScenario(t, false, c.attempts, c.batch, c.values, c.mk)
			on := laneScenario(t, true, c.attempts, c.batch, c.values, c.mk)
			if on.String() != off.String() {
				t.Fatalf("with the lane:\n%v\nwithout it:\n%v", on, off)
			}
		})
	}
}

// A handler's panic(nil) is a panic whatever GODEBUG says: with
// panicnil=1 (the default of a main module whose go.mod says go 1.20 or
// older, or a //go:debug line) recover returns nil for it, and the inline
// guard took that for a normal return: the handler's half-done writes were
// committed and the record reported applied. Off the lane (and on main)
// it is a failed attempt. Not parallel: GODEBUG is the process's.
func TestLanePanicNilUnderGODEBUG(t *testing.T) {
	t.Setenv("GODEBUG", "panicnil=1")
	for _, onLane := range []bool{false, true} {
		t.Run(fmt.Sprintf("lane=%v", onLane), func(t *testing.T) {
			run := laneScenario(t, onLane, 1, false, []string{`{"id":"pn","amount":1}`}, func(calls *atomic.Int64) idem.EventHandler {
				return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
					calls.Add(1)
					if err := insertEffect(ctx, tx, e); err != nil {
						return err
					}
					panic(nil)
				})
			})
			if len(run.Outcomes) != 1 || run.Outcomes[0] != "dead-lettered" || run.Effects != 0 || len(run.Dead) != 1 {
				t.Fatalf("a handler that panicked with nil: %v", run)
			}
		})
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
			p, err := idem.NewProcessor(store, idem.ProcessorConfig{
				Retry: idem.RetryPolicy{MaxAttempts: 2, Initial: time.Hour, Max: time.Hour},
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if onLane {
				lane, stop := guardlane.With(ctx)
				defer stop()
				ctx = lane
			}
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
			if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed_events) + (SELECT count(*) FROM idem_dead_letters)`); n != 0 {
				t.Fatalf("%d rows written, want 0", n)
			}
		})
	}
}

// A handler that calls Processor.Process itself with the context it got
// (which carries the lane), directly and from goroutines it waits for:
// nothing deadlocks, each inner record is applied once, and with -race
// nothing races.
func TestLaneNestedProcess(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 3)
	var innerCalls atomic.Int64
	inner := idem.Consume(idem.EventSpec[event]{Topic: "events", Context: "inner", EventID: func(e event) string { return *e.ID }},
		func(ctx context.Context, tx pgx.Tx, e event) error {
			if n := innerCalls.Add(1); n == 3 || n == 7 {
				runtime.Goexit() // twice: retried
			}
			return insertEffect(ctx, tx, e)
		})
	outer := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		sub := func(i int) error {
			id := fmt.Sprintf("%s-inner-%d", *e.ID, i)
			o, err := p.Process(ctx, &inner, &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(`{"id":"` + id + `","amount":1}`)})
			if err == nil && o != idem.Applied {
				err = fmt.Errorf("inner %s: %v", id, o)
			}
			return err
		}
		if err := sub(0); err != nil {
			return err
		}
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for i := 1; i <= 4; i++ {
			wg.Add(1)
			go func() { defer wg.Done(); errs <- sub(i) }()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, e)
	})
	lane, stop := guardlane.With(context.Background())
	defer stop()
	for i := range 3 {
		id := fmt.Sprintf("outer-%d", i)
		if o := laneProcess(t, p, lane, &outer, &idem.Record{Topic: "events", Offset: int64(i), Value: []byte(`{"id":"` + id + `","amount":1}`)}); o != idem.Applied {
			t.Fatalf("%s: %v", id, o)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 3*5+3 {
		t.Fatalf("%d effects, want %d", n, 3*5+3)
	}
	if n := pgtest.Count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != 3*5+3 {
		t.Fatalf("%d distinct effects, want %d", n, 3*5+3)
	}
}
