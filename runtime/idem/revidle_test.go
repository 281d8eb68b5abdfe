package idem_test

import (
	"context"
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

// slowNetworkDB is a new schema, reached directly and through a fault
// proxy.
func slowNetworkDB(t *testing.T) (direct, proxied *pgxpool.Pool, px *faultproxy.Proxy) {
	t.Helper()
	url := pgtest.Schema(t)
	px = faultproxy.New(t, faultproxy.PostgresTarget(url))
	return pgtest.PoolURL(t, url, nil), pgtest.PoolURL(t, px.RewriteURL(url), nil), px
}

// A handler that is never idle (its time is spent inside its own
// statements) is ended by idle_in_transaction_session_timeout when the
// network slows down under it: the server answered a statement and sits
// idle while the answer, then the next statement, crawl through the
// network. The handler's run is long (it waited on the database), the
// runtime's time after it short, so the rule that charges 25P03 to a
// handler that ran at least the timeout charged a network blip to the
// record: with a budget of one attempt, a good record was dead-lettered
// (and on the HTTP path the client was told 500 "Transaction idle too
// long", a bug of its function, for a slow network). It is an outage: the
// handler never held the transaction idle itself, so the record waits and
// is applied once the network is back.
func TestSlowNetworkUnderBusyHandlerIsNoAttempt(t *testing.T) {
	t.Parallel()
	direct, proxied, px := slowNetworkDB(t)
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	var logs lockedBuffer
	p, err := idem.NewProcessor(idem.NewStore(proxied), idem.ProcessorConfig{
		Retry:                    idem.RetryPolicy{MaxAttempts: 1},
		Outage:                   idem.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		IdleInTransactionTimeout: 200 * time.Millisecond,
		StorageTimeout:           5 * time.Second,
		Logger:                   slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		n := calls.Add(1)
		// Busy in the database, never idle: the server is running it.
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.3)`); err != nil {
			return err
		}
		if n == 1 {
			// The network slows down now (one way 300ms, more than the
			// idle timeout), for the rest of this attempt: a blip, not
			// the handler. The next statement's round trip leaves the
			// server idle past the timeout.
			px.Latency(300 * time.Millisecond)
			defer px.Latency(0)
		}
		return insertEffect(ctx, tx, e)
	})
	o, err := processWithin(p, &h, idleRecord("slow-net"), 30*time.Second)
	if err != nil || o != idem.Applied {
		t.Fatalf("Process: %v, %v after %d calls; want applied once the network is back (logs:\n%s)", o, err, calls.Load(), logs.String())
	}
	if n := calls.Load(); n < 2 {
		t.Fatalf("the handler ran %d times; the slow network did not end the first attempt, the test tests nothing", n)
	}
	if !strings.Contains(logs.String(), "25P03") {
		t.Fatalf("the first attempt did not end with 25P03; logs:\n%s", logs.String())
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters, want 0", n)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// The HTTP side of TestSlowNetworkUnderBusyHandlerIsNoAttempt: a function
// busy in its own statements, ended by the idle timeout because the
// network slowed down under it, was answered 500 "Transaction idle too
// long" (its bug, do not retry as is) for a blip of the network. It is a
// 503 "storage unavailable; retry later"; nothing was done, and the retry
// with the same key runs the function once.
func TestSlowNetworkUnderBusyFunctionIs503(t *testing.T) {
	_, proxied, px := slowNetworkDB(t)
	e := newEnvPool(t, proxied)
	e.cfg.IdleInTransactionTimeout = 200 * time.Millisecond
	logs := &lockedBuffer{}
	e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	var hooked atomic.Int64
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.3)`); err != nil {
			return err
		}
		if hooked.Add(1) == 1 {
			px.Latency(300 * time.Millisecond) // the network slows down now
			defer px.Latency(0)
		}
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}
	h := e.handler(idem.Endpoint{})
	r := do(h, "k-slow-net", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if strings.Contains(string(r.body), "idle") {
		t.Fatalf("%d %s; a slow network answered as the function's idling", r.status, r.body)
	}
	if !strings.Contains(logs.String(), "25P03") {
		t.Fatalf("the first request did not end with 25P03; logs:\n%s", logs)
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys, want 0, 0", e.effects(), e.keys())
	}
	r = do(h, "k-slow-net", body1)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s, want 201 from a run", r.status, r.body)
	}
	if e.calls.Load() != 2 || e.effects() != 1 {
		t.Fatalf("retry: %d calls, %d effects, want 2, 1", e.calls.Load(), e.effects())
	}
}

// In batch mode the records' handlers share one transaction, and a
// handler's SET LOCAL lasts until its end: the next records' handlers run
// under it. A statement_timeout one handler set cancelled the next
// handler's statement (57014), and the batch charged that attempt to the
// next record (batchRecordFailure): with a budget of one attempt, a record
// that applies fine on its own was dead-lettered. A 57014 in a batch is
// not the record's verdict; the batch falls back record by record, where a
// handler's own statement_timeout is charged to it.
func TestBatchStatementTimeoutLeakedByEarlierHandlerIsNoAttempt(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	var logs lockedBuffer
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry:  idem.RetryPolicy{MaxAttempts: 1},
		Outage: idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		switch *e.ID {
		case "sets-timeout":
			// Meant for this handler's own statements.
			if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '50ms'`); err != nil {
				return err
			}
		case "slow":
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.2)`); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, e)
	})
	recs := []*idem.Record{
		{Topic: "events", Offset: 0, Value: []byte(`{"id":"sets-timeout","amount":1}`)},
		{Topic: "events", Offset: 1, Value: []byte(`{"id":"slow","amount":1}`)},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	outs, err := p.ProcessBatch(ctx, &h, recs)
	if err != nil {
		t.Fatal(err)
	}
	if outs[0] != idem.Applied || outs[1] != idem.Applied {
		t.Fatalf("outcomes %v, want both applied (each applies on its own)", outs)
	}
	if l := logs.String(); !strings.Contains(l, "batch failed; applying its records one by one") || !strings.Contains(l, "57014") {
		t.Fatalf("the batch did not fail with the leaked statement_timeout; logs:\n%s", l)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters, want 0", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("%d effects, want 2", n)
	}
}
