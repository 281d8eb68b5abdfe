package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// commitExitTracer is a pgx tracer, the application's, that ends the
// goroutine it runs on (runtime.Goexit) in TraceBatchEnd of a batch that
// holds a COMMIT — after the server answered it: the transaction is
// committed — while exits says so.
type commitExitTracer struct {
	exits   atomic.Int64
	atStart bool // in TraceBatchStart instead: before the COMMIT is sent
}

type commitBatchKey struct{}

func (e *commitExitTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (e *commitExitTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
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
func (e *commitExitTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
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
			pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr })
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			store := idem.NewStore(pool)
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
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	store := idem.NewStore(pool)
	logs := newLineLog()
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Logger: slog.New(logs),
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
	lane, stop := guardlane.With(context.Background())
	defer stop()
	tr.exits.Store(1)
	ctx, cancel := context.WithTimeout(lane, 20e9)
	defer cancel()
	outcomes, err := p.ProcessBatch(ctx, &h, batchRecords("bc", 5))
	if err != nil {
		t.Fatal(err)
	}
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

// onceExitingLog is a slog.Handler, the application's, that ends the
// goroutine it runs on once, at the first line whose message is msg.
type onceExitingLog struct {
	msg   string
	exits *atomic.Int64
}

func (e onceExitingLog) Enabled(context.Context, slog.Level) bool { return true }
func (e onceExitingLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message == e.msg && e.exits.Add(1) == 1 {
		runtime.Goexit()
	}
	return nil
}
func (e onceExitingLog) WithAttrs([]slog.Attr) slog.Handler { return e }
func (e onceExitingLog) WithGroup(string) slog.Handler      { return e }

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
			p, err := idem.NewProcessor(store, idem.ProcessorConfig{
				Retry:  idem.RetryPolicy{MaxAttempts: tc.attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				Logger: slog.New(onceExitingLog{msg: "dead-lettering record", exits: &exits}),
			})
			if err != nil {
				t.Fatal(err)
			}
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
			dl, err := store.DeadLetter(context.Background(), 1)
			if err != nil {
				t.Fatal(err)
			}
			if dl.Attempts != tc.used || !strings.Contains(dl.LastError, tc.want) {
				t.Errorf("dead letter: attempts %d, error %q; want %d, %q", dl.Attempts, dl.LastError, tc.used, tc.want)
			}
			if tc.name != "decode" && calls.Load() != int64(tc.attempts) {
				t.Errorf("handler ran %d times, want %d", calls.Load(), tc.attempts)
			}
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
	rec := func(id string) string { return `{"id":"` + id + `","amount":1}` }
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
			return idem.Consume(idem.EventSpec[event]{
				Topic: "events", Context: "ctx",
				EventID: func(e event) string { return *e.ID },
				Decode: func(b []byte) (e event, err error) {
					if err := json.Unmarshal(b, &e); err != nil {
						return e, err
					}
					if *e.ID == "d" {
						runtime.Goexit()
					}
					return e, nil
				},
			}, func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
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
			off := laneScenario(t, false, c.attempts, true, c.values, c.mk)
			on := laneScenario(t, true, c.attempts, true, c.values, c.mk)
			if on.String() != off.String() {
				t.Fatalf("with the lane:\n%v\nwithout it:\n%v", on, off)
			}
			t.Logf("%v", on)
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
				base := context.Background()
				if onLane {
					lane, stop := guardlane.With(base)
					defer stop()
					base = lane
				}
				ctx, cancel := context.WithCancel(base)
				defer cancel()
				h := idem.Consume(idem.EventSpec[event]{
					Topic: "events", Context: "ctx",
					EventID: func(e event) string { return *e.ID },
					Decode: func(b []byte) (e event, err error) {
						if err := json.Unmarshal(b, &e); err != nil {
							return e, err
						}
						if how == "decoder Goexit" && *e.ID == "cx-3" {
							cancel()
							runtime.Goexit()
						}
						return e, nil
					},
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
				if n := pgtest.Count(t, pool, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed_events) + (SELECT count(*) FROM idem_dead_letters)`); n != 0 {
					t.Fatalf("%d rows written, want 0", n)
				}
			})
		}
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
			pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr })
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			store := idem.NewStore(pool)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error { calls.Add(1); return insertEffect(ctx, tx, e) })
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
				dl, err := store.DeadLetter(context.Background(), 1)
				if err != nil {
					t.Fatal(err)
				}
				if want := "panic in the consumer's hooks (a logger, meter or tracer) while applying the record: called runtime.Goexit"; dl.Attempts != 3 || dl.LastError != want {
					t.Errorf("dead letter: attempts %d, error %q", dl.Attempts, dl.LastError)
				}
			} else if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
				t.Errorf("%d dead letters", n)
			}
		})
	}
}
