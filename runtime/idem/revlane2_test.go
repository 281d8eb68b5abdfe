package idem_test

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"slices"
	"strings"
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
type commitExitTracer struct{ exits atomic.Int64 }

type commitBatchKey struct{}

func (e *commitExitTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (e *commitExitTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (e *commitExitTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if strings.EqualFold(strings.TrimSpace(q.SQL), "commit") {
			return context.WithValue(ctx, commitBatchKey{}, true)
		}
	}
	return ctx
}
func (e *commitExitTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (e *commitExitTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	if ctx.Value(commitBatchKey{}) != nil && d.Err == nil && e.exits.Add(-1) >= 0 {
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
