package idem_test

import (
	"context"
	"encoding/json"
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

// gid is the id of the goroutine it runs on ("goroutine N [running]:").
func gid() string {
	b := make([]byte, 64)
	return strings.Fields(string(b[:runtime.Stack(b, false)]))[1]
}

// batchGoroutines is a pgx tracer that notes the goroutine every batch
// (the runtime's pipelines: BEGIN with the processed-event insert, the
// checked COMMIT) is sent from.
type batchGoroutines struct {
	noopTracer
	mu  sync.Mutex
	ids map[string]int
}

func (b *batchGoroutines) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ids[gid()]++
	return ctx
}

// noopTracer is a pgx.QueryTracer and pgx.BatchTracer that does nothing:
// the test tracers embed it and define only the hooks they use.
type noopTracer struct{}

func (noopTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (noopTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (noopTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (noopTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (noopTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// laneIf is ctx on a new lane when onLane (as the Kafka consumer's
// partition loop calls Process), else ctx itself; stop ends the lane.
func laneIf(ctx context.Context, onLane bool) (context.Context, func()) {
	if !onLane {
		return ctx, func() {}
	}
	return guardlane.With(ctx)
}

// decodingThen is handler(fn) with a decoder of its own that, once it has
// decoded an event, calls then with it (then may end the goroutine).
func decodingThen(then func(e event), fn func(context.Context, pgx.Tx, event) error) idem.EventHandler {
	return idem.Consume(idem.EventSpec[event]{
		Topic: "events", Context: "ctx",
		EventID: func(e event) string { return *e.ID },
		Decode: func(b []byte) (e event, err error) {
			if err := json.Unmarshal(b, &e); err != nil {
				return e, err
			}
			then(e)
			return e, nil
		},
	}, fn)
}

// countingInsert is a handler that counts its call in calls, writes the
// event's effect and then, when then is not nil, calls then with the
// call's number (then may fail the attempt by panicking or Goexiting).
func countingInsert(calls *atomic.Int64, then func(n int64)) func(context.Context, pgx.Tx, event) error {
	return func(ctx context.Context, tx pgx.Tx, e event) error {
		n := calls.Add(1)
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if then != nil {
			then(n)
		}
		return nil
	}
}

// eventJSON is a record's value: the event id with amount 1.
func eventJSON(id string) string { return `{"id":"` + id + `","amount":1}` }

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

// laneProcess is processBounded with the lane's context, as the Kafka
// consumer's partition loop calls Process.
func laneProcess(t *testing.T, p *idem.Processor, lane context.Context, h *idem.EventHandler, rec *idem.Record) idem.Outcome {
	t.Helper()
	return processBoundedIn(t, lane, p, h, rec)
}

// laneProcessBatch is ProcessBatch with the lane's context, bounded as
// processBoundedIn bounds Process: an error fails the test.
func laneProcessBatch(t *testing.T, p *idem.Processor, lane context.Context, h *idem.EventHandler, recs []*idem.Record) []idem.Outcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(lane, 20*time.Second)
	defer cancel()
	outcomes, err := p.ProcessBatch(ctx, h, recs)
	if err != nil {
		t.Fatal(err)
	}
	return outcomes
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
	p := processorWith(t, store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		Logger: slog.New(logs),
	})
	var calls atomic.Int64
	h := mk(&calls)
	ctx, stop := laneIf(context.Background(), onLane)
	defer stop()
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

// matchesOffLane runs a scenario off the lane and then on it, fails the
// test unless both end alike, and returns the run on the lane.
func matchesOffLane(t *testing.T, attempts int, batch bool, values []string, mk func(calls *atomic.Int64) idem.EventHandler) laneRun {
	t.Helper()
	off := laneScenario(t, false, attempts, batch, values, mk)
	on := laneScenario(t, true, attempts, batch, values, mk)
	if on.String() != off.String() {
		t.Fatalf("with the lane:\n%v\nwithout it:\n%v", on, off)
	}
	return on
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
	rec := eventJSON
	insertThen := func(then func(calls int64)) func(calls *atomic.Int64) idem.EventHandler {
		return func(calls *atomic.Int64) idem.EventHandler { return handler(countingInsert(calls, then)) }
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
				}, countingInsert(calls, nil))
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
			matchesOffLane(t, c.attempts, c.batch, c.values, c.mk)
		})
	}
}

// Batch mode on the lane (applyBatchGuarded: the whole batch on the
// worker, its user code inline) ends, for each kind of odd user code in a
// batch, exactly as a batch off the lane (each call of user code on a
// goroutine of its own, as main does): outcomes, handler runs, rows, dead
// letters and log lines.
func TestLaneBatchMatchesOffLane(t *testing.T) {
	t.Parallel()
	rec := eventJSON
	five := []string{rec("a"), rec("b"), rec("c"), rec("d"), rec("e")}
	// at runs then in the handler of the record with id, on its n-th call,
	// after the record's effect is written; every other call applies.
	at := func(id string, then func(n int64)) func(calls *atomic.Int64) idem.EventHandler {
		return func(calls *atomic.Int64) idem.EventHandler {
			var mu sync.Mutex
			seen := map[string]int64{}
			return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				mu.Lock()
				seen[*e.ID]++
				n := seen[*e.ID]
				mu.Unlock()
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				if *e.ID == id {
					then(n)
				}
				return nil
			})
		}
	}
	cases := []struct {
		name     string
		attempts int
		values   []string
		mk       func(calls *atomic.Int64) idem.EventHandler
	}{
		{"Goexit in the middle, once", 3, five, at("c", func(n int64) {
			if n == 1 {
				runtime.Goexit()
			}
		})},
		{"Goexit in the middle, always", 3, five, at("c", func(int64) { runtime.Goexit() })},
		{"Goexit in the last record, budget 1", 1, five, at("e", func(int64) { runtime.Goexit() })},
		{"panic in a deferred call during Goexit", 2, five, at("b", func(n int64) {
			if n == 1 {
				defer func() { panic("boom in defer") }()
				runtime.Goexit()
			}
		})},
		{"panic(nil)", 2, five, at("d", func(n int64) {
			if n == 1 {
				panic(nil)
			}
		})},
		{"panic, then Goexit, then applies", 3, five, at("b", func(n int64) {
			switch n {
			case 1:
				panic("once")
			case 2:
				runtime.Goexit()
			}
		})},
		{"Goexit in the first record, a duplicate id later", 2, []string{rec("a"), rec("b"), rec("a"), rec("c")}, at("a", func(n int64) {
			if n == 1 {
				runtime.Goexit()
			}
		})},
		{"Goexit after its own statement failed", 2, five, func(calls *atomic.Int64) idem.EventHandler {
			return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				n := calls.Add(1)
				if *e.ID == "c" && n == 3 {
					if _, err := tx.Exec(ctx, `SELECT 1/0`); err != nil {
						runtime.Goexit()
					}
				}
				return insertEffect(ctx, tx, e)
			})
		}},
		{"Goexit in the decoder of one record", 3, five, func(calls *atomic.Int64) idem.EventHandler {
			return decodingThen(func(e event) {
				if *e.ID == "d" {
					runtime.Goexit()
				}
			}, countingInsert(calls, nil))
		}},
		{"handler error in the middle, then Goexit", 3, five, at("c", func(n int64) {
			if n == 2 {
				runtime.Goexit()
			}
		})},
	}
	// The last case's first failure is an error, not a Goexit: make it so.
	cases[len(cases)-1].mk = func(calls *atomic.Int64) idem.EventHandler {
		var c atomic.Int64
		return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
			calls.Add(1)
			if err := insertEffect(ctx, tx, e); err != nil {
				return err
			}
			if *e.ID == "c" {
				switch c.Add(1) {
				case 1:
					return errors.New("refused once")
				case 2:
					runtime.Goexit()
				}
			}
			return nil
		})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			on := matchesOffLane(t, c.attempts, true, c.values, c.mk)
			t.Logf("%v", on)
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
				return handler(countingInsert(calls, func(int64) { panic(nil) }))
			})
			if len(run.Outcomes) != 1 || run.Outcomes[0] != "dead-lettered" || run.Effects != 0 || len(run.Dead) != 1 {
				t.Fatalf("a handler that panicked with nil: %v", run)
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
