package idem_test

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// idleRecord is the record the idle-timeout tests process.
func idleRecord(id string) *idem.Record {
	return &idem.Record{Topic: "events", Value: []byte(`{"id":"` + id + `","amount":1}`)}
}

// lastDeadLetter is the newest dead letter's attempts and last error.
func lastDeadLetter(t *testing.T, pool *pgxpool.Pool) (int32, string) {
	t.Helper()
	var attempts int32
	var last string
	if err := pool.QueryRow(context.Background(),
		`SELECT attempts, last_error FROM idem_dead_letters ORDER BY id DESC LIMIT 1`).Scan(&attempts, &last); err != nil {
		t.Fatal(err)
	}
	return attempts, last
}

// wantDeadLetter fails the test unless the newest dead letter has the
// given attempts and each of lastHas in its last error.
func wantDeadLetter(t *testing.T, pool *pgxpool.Pool, attempts int32, lastHas ...string) {
	t.Helper()
	got, last := lastDeadLetter(t, pool)
	ok := got == attempts
	for _, s := range lastHas {
		ok = ok && strings.Contains(last, s)
	}
	if !ok {
		t.Fatalf("dead letter: %d attempts, last error %q; want %d and %q in it", got, last, attempts, lastHas)
	}
}

// wantRuns fails the test unless the handler ran (calls) want times; why
// says what want is.
func wantRuns(t *testing.T, calls *atomic.Int64, want int64, why string) {
	t.Helper()
	if n := calls.Load(); n != want {
		t.Fatalf("the handler ran %d times, want %d (%s)", n, want, why)
	}
}

// A handler that holds its transaction idle past
// idle_in_transaction_session_timeout on every attempt (a slow downstream
// call, a sleep) makes the server end the session every time: at COMMIT,
// or at the handler's next statement. That was waited out as a storage
// outage, forever ("storage unavailable; waiting, no attempt used"), and
// the record's partition was blocked for good. The runtime timed the
// handler (longer than the timeout, the runtime's own time after it
// short): it is the record's failure, which uses the budget and ends as a
// dead letter saying what happened. The timeout is the runtime's
// (IdleInTransactionTimeout) or, left to the session, the server's.
func TestHandlerIdlePastTimeoutIsDeadLettered(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		configured time.Duration // IdleInTransactionTimeout
		session    string        // the connections' own setting, when not ""
		statement  bool          // the handler runs a statement after idling
		oneConn    bool          // a pool of one connection
	}{
		"configured, COMMIT ends":        {configured: 100 * time.Millisecond},
		"configured, statement ends":     {configured: 100 * time.Millisecond, statement: true},
		"session's setting, COMMIT ends": {configured: -1, session: "100"},
		// The session's timeout is read on another connection than the
		// attempt's, which must be back in the pool by then.
		"session's setting, pool of one": {configured: -1, session: "100", oneConn: true},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// The schema is made on a pool of its own: on the pool with
			// the 100 ms server setting, a Migrate whose transaction
			// idled 100 ms between statements on a loaded machine was
			// ended by it (the test failed once in five loaded runs).
			url := pgtest.Schema(t)
			setup := pgtest.PoolURL(t, url, nil)
			if err := idem.Migrate(context.Background(), setup); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, setup, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			setup.Close()
			pool := pgtest.PoolURL(t, url, func(cfg *pgxpool.Config) {
				if c.session != "" {
					cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = c.session
				}
				if c.oneConn {
					cfg.MaxConns = 1
				}
			})
			p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{
				Retry:                    idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				Outage:                   idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
				IdleInTransactionTimeout: c.configured,
				StorageTimeout:           time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				if err := insertEffect(ctx, tx, e); err != nil {
					return err
				}
				time.Sleep(400 * time.Millisecond) // idle in transaction, every attempt
				if c.statement {
					return insertEffect(ctx, tx, e)
				}
				return nil
			})
			o, err := processWithin(p, &h, idleRecord("idle"), 20*time.Second)
			if err != nil || o != idem.DeadLettered {
				t.Fatalf("Process: %v, %v after %d calls; want dead-lettered after the budget", o, err, calls.Load())
			}
			wantRuns(t, &calls, 3, "the budget")
			wantDeadLetter(t, pool, 3, "idle_in_transaction_session_timeout (100ms)", "25P03")
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
				t.Fatalf("%d effects, want 0", n)
			}
		})
	}
}

// A handler whose own statement hits statement_timeout on every attempt
// (57014, the runtime's context alive) was waited out as an outage
// forever. It is the record's failure: the budget, then a dead letter.
func TestHandlerStatementTimeoutIsDeadLettered(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p := processor(t, store, 3)
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '50ms'`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
		return err
	})
	o, err := processWithin(p, &h, idleRecord("slow-statement"), 20*time.Second)
	if err != nil || o != idem.DeadLettered {
		t.Fatalf("Process: %v, %v after %d calls; want dead-lettered after the budget", o, err, calls.Load())
	}
	wantRuns(t, &calls, 3, "the budget")
	wantDeadLetter(t, pool, 3, "statement_timeout", "57014")
}

// One slow attempt (the handler idles past the timeout once) uses one
// attempt; the next succeeds: applied once, no dead letter.
func TestSlowAttemptThenSuccessAppliesOnce(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:                    idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage:                   idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		IdleInTransactionTimeout: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			time.Sleep(400 * time.Millisecond)
		}
		return nil
	})
	o, err := processWithin(p, &h, idleRecord("slow-once"), 20*time.Second)
	if err != nil || o != idem.Applied {
		t.Fatalf("Process: %v, %v; want applied", o, err)
	}
	if c := calls.Load(); c != 2 {
		t.Fatalf("handler ran %d times, want 2", c)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters, want none", n)
	}
}

// commitFreezer holds the runtime's goroutine before the next COMMIT is
// sent (armed once), as a process frozen in the runtime's own code between
// the handler's return and the COMMIT (SIGSTOP, a GC pause, a paused VM)
// is held.
type commitFreezer struct {
	armed atomic.Bool
	hold  time.Duration
}

func (f *commitFreezer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (f *commitFreezer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (f *commitFreezer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	for _, q := range data.Batch.QueuedQueries {
		if strings.EqualFold(q.SQL, "commit") && f.armed.CompareAndSwap(true, false) {
			time.Sleep(f.hold)
		}
	}
	return ctx
}
func (f *commitFreezer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (f *commitFreezer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// The HTTP path under the same rule: a function that idles past the
// timeout (the server ends the session at COMMIT, or at its next
// statement), or whose statement hits statement_timeout, is answered a 500
// problem saying so: not a 503 "storage unavailable; retry later" nor
// "Outcome unknown", which invite retries that fail the same way. Nothing
// is stored, the key is free: the retry with the same key runs the
// function (now quick) and commits once.
func TestFunctionIdleOrStatementTimeoutIsFunctionFailure(t *testing.T) {
	cases := map[string]struct {
		keyed   bool
		session bool // NoIdleInTransactionTimeout, the session's 100ms, a pool of one
		hook    func(ctx context.Context, tx pgx.Tx) error
		title   string
	}{
		"idle, COMMIT ends, keyed": {keyed: true, title: "Transaction idle too long",
			hook: func(context.Context, pgx.Tx) error { time.Sleep(400 * time.Millisecond); return nil }},
		"idle, COMMIT ends, no key": {title: "Transaction idle too long",
			hook: func(context.Context, pgx.Tx) error { time.Sleep(400 * time.Millisecond); return nil }},
		"idle, session's setting, pool of one": {keyed: true, session: true, title: "Transaction idle too long",
			hook: func(context.Context, pgx.Tx) error { time.Sleep(400 * time.Millisecond); return nil }},
		"idle, statement ends": {keyed: true, title: "Transaction idle too long",
			hook: func(ctx context.Context, tx pgx.Tx) error {
				time.Sleep(400 * time.Millisecond)
				_, err := tx.Exec(ctx, `SELECT 1`)
				return err
			}},
		"statement_timeout": {keyed: true, title: "Statement cancelled",
			hook: func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '50ms'`); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
				return err
			}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			var e *env
			if c.session {
				e = newEnvPool(t, pgtest.PoolConfig(t, func(cfg *pgxpool.Config) {
					cfg.MaxConns = 1
					cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "100"
				}))
				e.cfg.NoIdleInTransactionTimeout = true
			} else {
				e = newEnv(t)
				e.cfg.IdleInTransactionTimeout = 100 * time.Millisecond
			}
			logs := e.captureLogs()
			fix := e.hookUntilFixed(c.hook)
			h := e.handler(idem.Endpoint{KeyOptional: !c.keyed})
			key := ""
			if c.keyed {
				key = "k-slow"
			}
			r := do(h, key, body1)
			wantProblem(t, r, http.StatusInternalServerError)
			if !strings.Contains(string(r.body), c.title) || r.header.Get("Retry-After") != "" {
				t.Fatalf("%d %s (Retry-After %q); want a 500 %q without Retry-After", r.status, r.body, r.header.Get("Retry-After"), c.title)
			}
			if strings.Contains(logs.String(), "storage") {
				t.Fatalf("logged as a storage failure:\n%s", logs)
			}
			wantRetryRunsAgain(t, e, h, key, fix)
		})
	}
}
