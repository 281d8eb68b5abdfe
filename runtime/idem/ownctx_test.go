package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// proxiedConsumeDB is a migrated schema with an effects table, reached
// directly and through a fault proxy whose pool configure adjusts.
func proxiedConsumeDB(t *testing.T, configure func(*pgxpool.Config)) (direct, proxied *pgxpool.Pool, px *faultproxy.Proxy) {
	t.Helper()
	url := pgtest.Schema(t)
	px = faultproxy.New(t, faultproxy.PostgresTarget(url))
	direct = pgtest.PoolURL(t, url, nil)
	proxied = pgtest.PoolURL(t, px.RewriteURL(url), configure)
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return direct, proxied, px
}

// budgetOfOne is a processor on pool with a budget of one attempt (a
// failure wrongly charged to the record dead-letters it at once), outages
// waited out 10-50ms apart, storage calls bounded by storageTimeout, and
// its log.
func budgetOfOne(t *testing.T, pool *pgxpool.Pool, storageTimeout time.Duration) (*idem.Processor, *lockedBuffer) {
	t.Helper()
	logs := &lockedBuffer{}
	return processorWith(t, idem.NewStore(pool), idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		StorageTimeout: storageTimeout,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
	}), logs
}

// faultOnFirstCall is a handler that inserts its effect, then, on its
// first call only, starts fault (the network's, under the statement to
// come), then runs fn; calls counts its calls.
func faultOnFirstCall(calls *atomic.Int64, fault func(), fn func(context.Context, pgx.Tx) error) idem.EventHandler {
	return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			fault()
		}
		return fn(ctx, tx)
	})
}

// ownCtxProcessor is a processor on store with a budget of attempts,
// retries and outages waited out within milliseconds, and storage calls
// bounded by storageTimeout (the own-context probe's bound).
func ownCtxProcessor(t *testing.T, store *idem.Store, attempts int, storageTimeout time.Duration) *idem.Processor {
	t.Helper()
	return processorWith(t, store, idem.ProcessorConfig{
		Retry:          idem.RetryPolicy{MaxAttempts: attempts, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage:         idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		StorageTimeout: storageTimeout,
	})
}

// ownCtxDeadlineHandler is a handler that inserts its effect, then runs a
// statement its own 50ms deadline ends (ownCtxStatement).
func ownCtxDeadlineHandler() idem.EventHandler {
	return handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		return ownCtxStatement(ctx, tx, false)
	})
}

// wantAppliedOnce fails the test unless the record was applied once (one
// effect) and never dead-lettered, as read on direct.
func wantAppliedOnce(t *testing.T, direct *pgxpool.Pool) {
	t.Helper()
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters, want 0", n)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// ownCtxStatement runs a statement that outlives ctxFor's context: a
// deadline of 50ms, or a cancel 50ms in. With pgx's default context
// watcher (pgconn.DeadlineContextWatcherHandler) the context ending in
// mid-statement closes the connection.
func ownCtxStatement(ctx context.Context, tx pgx.Tx, cancelled bool) error {
	return ownCtxExec(ctx, tx, cancelled, 50*time.Millisecond, `SELECT pg_sleep(1)`)
}

// ownCtxExec runs sql under a context of its own that ends after d: a
// deadline, or a cancel when cancelled.
func ownCtxExec(ctx context.Context, tx pgx.Tx, cancelled bool, d time.Duration, sql string) error {
	var qctx context.Context
	var cancel context.CancelFunc
	if cancelled {
		qctx, cancel = context.WithCancel(ctx)
		time.AfterFunc(d, cancel)
	} else {
		qctx, cancel = context.WithTimeout(ctx, d)
	}
	defer cancel()
	_, err := tx.Exec(qctx, sql)
	return err
}

// ownCtxHandlers are handlers whose statement the handler's own context
// ends, as they report it: the error as is, the error wrapped without its
// chain (%v), or swallowed (nil returned on the closed connection).
var ownCtxHandlers = ownCtxHandlersWithin(50 * time.Millisecond)

// ownCtxHandlersWithin is ownCtxHandlers with their statement's own
// context ending after d (pg_sleep lasting 20 times that).
func ownCtxHandlersWithin(d time.Duration) map[string]func(ctx context.Context, tx pgx.Tx) error {
	stmt := func(ctx context.Context, tx pgx.Tx, cancelled bool) error {
		return ownCtxExec(ctx, tx, cancelled, d, fmt.Sprintf(`SELECT pg_sleep(%g)`, (20*d).Seconds()))
	}
	return map[string]func(ctx context.Context, tx pgx.Tx) error{
		"deadline": func(ctx context.Context, tx pgx.Tx) error {
			return stmt(ctx, tx, false)
		},
		"cancel": func(ctx context.Context, tx pgx.Tx) error {
			return stmt(ctx, tx, true)
		},
		"deadline, chain lost": func(ctx context.Context, tx pgx.Tx) error {
			if err := stmt(ctx, tx, false); err != nil {
				return fmt.Errorf("slow query: %v", err)
			}
			return nil
		},
		"deadline, error swallowed": func(ctx context.Context, tx pgx.Tx) error {
			_ = stmt(ctx, tx, false) //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		},
	}
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
			p := ownCtxProcessor(t, store, 3, 2*time.Second)
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
			// The budget of 3, and a free retry or two after a probe that
			// answered only slowly (dbAnswers' slowAnswer: a loaded machine
			// makes a connection slower than the 50ms deadline).
			if n := calls.Load(); n < 3 || n > 3*3 {
				t.Fatalf("the handler ran %d times, want the budget of 3 (up to 9 with slow probes)", n)
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
	p := ownCtxProcessor(t, store, 2, 2*time.Second)
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

// quickOwnCtxHandlers are handlers that bound a quick statement with a
// context of their own (200ms, a deadline or a cancel), reporting its
// failure as ownCtxHandlers do: on a healthy database they succeed.
var quickOwnCtxHandlers = map[string]func(ctx context.Context, tx pgx.Tx) error{
	"deadline": func(ctx context.Context, tx pgx.Tx) error {
		return ownCtxExec(ctx, tx, false, 200*time.Millisecond, `SELECT 1`)
	},
	"cancel": func(ctx context.Context, tx pgx.Tx) error {
		return ownCtxExec(ctx, tx, true, 200*time.Millisecond, `SELECT 1`)
	},
	"deadline, chain lost": func(ctx context.Context, tx pgx.Tx) error {
		if err := ownCtxExec(ctx, tx, false, 200*time.Millisecond, `SELECT 1`); err != nil {
			return fmt.Errorf("quick query: %v", err)
		}
		return nil
	},
	"deadline, error swallowed": func(ctx context.Context, tx pgx.Tx) error {
		_ = ownCtxExec(ctx, tx, false, 200*time.Millisecond, `SELECT 1`) //idemvet:ignore swallowcancel the mistake this test makes on purpose
		return nil
	},
}

// The fault under the fault: the handler's own deadline (or cancel) ends
// its statement because the database does not answer (a network
// partition), not because of the statement. That is an outage: no attempt
// used (a budget of one would dead-letter the record at once), the record
// waits and is applied once the database is back.
func TestHandlerOwnContextWhileDatabaseBlackholedIsNoAttempt(t *testing.T) {
	t.Parallel()
	for name, fn := range quickOwnCtxHandlers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			direct, proxied, px := proxiedConsumeDB(t, nil)
			p, logs := budgetOfOne(t, proxied, 300*time.Millisecond)
			var calls atomic.Int64
			h := faultOnFirstCall(&calls, func() {
				px.Blackhole() // the network partitions now, for 1.5s
				time.AfterFunc(1500*time.Millisecond, px.Restore)
			}, fn)
			o, err := processWithin(p, &h, idleRecord("blackholed"), 20*time.Second)
			if err != nil || o != idem.Applied {
				t.Fatalf("Process: %v, %v after %d calls; want applied once the database is back (logs:\n%s)", o, err, calls.Load(), logs.String())
			}
			if n := calls.Load(); n < 2 {
				t.Fatalf("the handler ran %d times; the partition did not end the first attempt, the test tests nothing", n)
			}
			if l := logs.String(); !strings.Contains(l, "storage unavailable; waiting, no attempt used") || strings.Contains(l, "handler failed") {
				t.Fatalf("the first attempt was not waited out as an outage; logs:\n%s", l)
			}
			wantAppliedOnce(t, direct)
		})
	}
}

// The HTTP side: a function whose own context ends its statement (pgx
// closes the connection) was answered 503 "request cancelled; nothing was
// done" (the request was not cancelled, and a retry ends the same way) or,
// when it swallowed the error, "Outcome unknown" (no COMMIT was sent). It
// is a 500 saying what happened, without Retry-After; nothing is stored,
// the key is free: the retry runs the function (now quick) once.
func TestFunctionOwnContextClosingConnIs500(t *testing.T) {
	t.Parallel()
	// A deadline of 500ms: the probe that tells the database answers must
	// answer in less than the statement had, and its connection is a new
	// one (the function's own context closed the pool's), which took up to
	// 280ms under load here; with 50ms the answer was 503 (a slow answer,
	// the database's benefit of the doubt) on a loaded machine.
	for name, fn := range ownCtxHandlersWithin(500 * time.Millisecond) {
		for _, keyed := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/keyed=%v", name, keyed), func(t *testing.T) {
				testFunctionOwnContextClosingConnIs500(t, fn, keyed)
			})
		}
	}
}

func testFunctionOwnContextClosingConnIs500(t *testing.T, fn func(context.Context, pgx.Tx) error, keyed bool) {
	e := newEnv(t)
	logs := e.captureLogs()
	fix := e.hookUntilFixed(fn)
	h := e.handler(idem.Endpoint{KeyOptional: !keyed})
	key := ""
	if keyed {
		key = "k-own-ctx"
	}
	r := do(h, key, body1)
	wantProblem(t, r, http.StatusInternalServerError)
	if !strings.Contains(string(r.body), "Statement ended by the function's own context") || r.header.Get("Retry-After") != "" {
		t.Fatalf("%d %s (Retry-After %q); want a 500 naming the function's own context, without Retry-After", r.status, r.body, r.header.Get("Retry-After"))
	}
	if strings.Contains(logs.String(), "storage") {
		t.Fatalf("logged as a storage failure:\n%s", logs)
	}
	wantRetryRunsAgain(t, e, h, key, fix)
}

// The HTTP fault under the fault: the function's own deadline ends its
// statement because the database does not answer. A 503 "storage
// unavailable; retry later" (nothing was done), not the function's 500;
// the retry once the database is back runs the function once.
func TestFunctionOwnContextWhileDatabaseBlackholedIs503(t *testing.T) {
	t.Parallel()
	for name, fn := range quickOwnCtxHandlers {
		t.Run(name, func(t *testing.T) {
			testFunctionOwnContextFaultIs503(t, fn, (*faultproxy.Proxy).Blackhole, (*faultproxy.Proxy).Restore)
		})
	}
}

// testFunctionOwnContextFaultIs503 runs fn as a function's statement under
// a network fault that fault starts on its first call: the answer is a 503
// storage unavailable with Retry-After, nothing is stored; once heal has
// run, the retry runs the function once (201).
func testFunctionOwnContextFaultIs503(t *testing.T, fn func(context.Context, pgx.Tx) error, fault, heal func(*faultproxy.Proxy)) {
	direct, proxied, px := slowNetworkDB(t)
	e := newEnvPool(t, proxied)
	var once atomic.Bool
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if once.CompareAndSwap(false, true) {
			fault(px)
		}
		return fn(ctx, tx)
	}
	h := e.handler(idem.Endpoint{})
	r := do(h, "k-fault", body1)
	heal(px)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if !strings.Contains(string(r.body), "storage unavailable") || r.header.Get("Retry-After") == "" {
		t.Fatalf("%d %s (Retry-After %q); want a 503 storage unavailable with Retry-After", r.status, r.body, r.header.Get("Retry-After"))
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`) + pgtest.Count(t, direct, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Fatalf("%d effects and keys, want 0", n)
	}
	r = do(h, "k-fault", body1)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s, want 201 from a run", r.status, r.body)
	}
	if e.calls.Load() != 2 || pgtest.Count(t, direct, `SELECT count(*) FROM effects`) != 1 {
		t.Fatalf("retry: %d calls, want 2, and one effect", e.calls.Load())
	}
}
