package idem_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// An event id PostgreSQL refuses to store can never be applied: a NUL byte
// (refused before any SQL), invalid UTF-8 (22021 from the dedupe insert) and
// an id too large for the processed-event index (54000). Each is
// dead-lettered on its first attempt with its raw bytes, and the next record
// is applied. The dedupe insert's refusals were charged as attempts, so the
// record spent its whole budget (MaxAttempts tries) on an id that fails
// every time.
func TestUnstorableEventIDDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			store := idem.NewStore(pool)
			p := processor(t, store, 5)
			var calls atomic.Int64
			// The id from the idem-event-id header: the broker's raw bytes.
			h := idem.Consume(idem.EventSpec[event]{Topic: "events", Context: "header"},
				func(ctx context.Context, tx pgx.Tx, e event) error {
					calls.Add(1)
					_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ('header', $1)`, e.Amount)
					return err
				})
			ids := map[string]string{"NUL byte": "a\x00b", "invalid UTF-8": "\xff\xfe", "too large for the index": unindexableID()}
			for name, id := range ids {
				rec := &idem.Record{Topic: "events", Key: []byte("k\xff\x00"), Value: []byte(`{"amount":1}`),
					Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(id)}}}
				if o := processBounded(t, p, &h, rec); o != idem.DeadLettered {
					t.Fatalf("%s: outcome %v, want dead-lettered", name, o)
				}
				var dlID int64
				if err := pool.QueryRow(context.Background(), `SELECT max(id) FROM idem_dead_letters`).Scan(&dlID); err != nil {
					t.Fatal(err)
				}
				dl, err := store.DeadLetter(context.Background(), dlID)
				if err != nil {
					t.Fatal(err)
				}
				got, _ := dl.Record.Header(idem.EventIDHeader)
				if dl.Attempts != 1 || !bytes.Equal(got, []byte(id)) || !bytes.Equal(dl.Record.Key, rec.Key) {
					t.Errorf("%s: dead letter after %d attempts (want 1), id header kept: %v, key %q; error %q",
						name, dl.Attempts, bytes.Equal(got, []byte(id)), dl.Record.Key, dl.LastError)
				}
			}
			if calls.Load() != 0 {
				t.Fatalf("the handler ran %d times for ids that cannot be stored", calls.Load())
			}
			after := &idem.Record{Topic: "events", Offset: 1, Value: []byte(`{"amount":1}`),
				Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte("after")}}}
			if o := processBounded(t, p, &h, after); o != idem.Applied {
				t.Fatalf("the record after them: %v, want applied", o)
			}
		})
	}
}

// A COMMIT that fails because the server ended the session (here FATAL
// 25P03, idle_in_transaction_session_timeout) while the process was frozen
// in the runtime's own code, after the handler returned (commitFreezer
// holds the COMMIT, as SIGSTOP or a GC pause would), is not the handler's
// doing: the record is retried on a fresh connection without using an
// attempt, and the processed-event row makes the retry safe. With a budget
// of one attempt it was dead-lettered, a valid record. (This test's
// handler used to sleep in its transaction itself to cause the timeout:
// that is a slow handler, now charged to the record, see
// TestHandlerIdlePastTimeoutIsDeadLettered; the freeze is moved to where a
// frozen process is not the handler's.)
func TestCommitAfterIdleSessionTimeoutIsNoAttempt(t *testing.T) {
	t.Parallel()
	// The handler's own time does not matter when it was busy: one that ran
	// a statement longer than the timeout (never idle) and then returned
	// before the freeze is no more the cause than a quick one.
	for name, busy := range map[string]string{"quick handler": "", "handler busy past the timeout": "SELECT pg_sleep(0.3)"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			commitAfterFreeze(t, busy)
		})
	}
}

func commitAfterFreeze(t *testing.T, busy string) {
	freeze := &commitFreezer{hold: time.Second}
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = freeze })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{
		Retry:                    idem.RetryPolicy{MaxAttempts: 1, Initial: time.Millisecond, Max: 2 * time.Millisecond},
		Outage:                   idem.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		IdleInTransactionTimeout: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if calls.Add(1) == 1 {
			if busy != "" {
				if _, err := tx.Exec(ctx, busy); err != nil {
					return err
				}
			}
			freeze.armed.Store(true) // the process freezes once this handler returns
		}
		return insertEffect(ctx, tx, e)
	})
	o, err := processWithin(p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"e1","amount":1}`)}, 20*time.Second)
	if err != nil || o != idem.Applied {
		t.Fatalf("Process: %v, %v; want applied", o, err)
	}
	if freeze.armed.Load() {
		t.Fatal("the COMMIT was never held")
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		var last string
		_ = pool.QueryRow(context.Background(), `SELECT last_error FROM idem_dead_letters`).Scan(&last)
		t.Fatalf("%d dead letters (%s), want none", n, last)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if c := calls.Load(); c != 2 {
		t.Fatalf("handler ran %d times, want 2 (the COMMIT of the first failed with the session)", c)
	}
}
