package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revrt). A handler whose own statement PostgreSQL refuses
// with 22021 (invalid UTF-8) or 54000 (an index row too large) is the
// handler's failure: it uses the retry budget, it is not taken for an
// unstorable event id and dead-lettered on its first attempt.
func TestRevrtHandlerDataErrorUsesBudget(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"22021": `INSERT INTO effects (event_id, amount) VALUES (convert_from('\xff'::bytea, 'UTF8'), 1)`,
		"54000": `INSERT INTO big_keys (k) SELECT string_agg(md5(g::text), '') FROM generate_series(1, 200) g`,
	}
	for code, stmt := range cases {
		t.Run(code, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			pgtest.Exec(t, pool, `CREATE TABLE big_keys (k text PRIMARY KEY)`)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				_, err := tx.Exec(ctx, stmt)
				return err
			})
			o := processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"h1","amount":1}`)})
			if o != idem.DeadLettered || calls.Load() != 3 {
				t.Fatalf("outcome %v after %d handler calls; want dead-lettered after the budget of 3", o, calls.Load())
			}
			var attempts int
			var last string
			if err := pool.QueryRow(context.Background(), `SELECT attempts, last_error FROM idem_dead_letters`).Scan(&attempts, &last); err != nil {
				t.Fatal(err)
			}
			if attempts != 3 || !strings.Contains(last, code) {
				t.Fatalf("dead letter: %d attempts, %q; want 3 and SQLSTATE %s", attempts, last, code)
			}
		})
	}
}

// Outside review (revrt). The dedupe insert refused with 22021 or 54000 for a
// reason that is not the event id (here a trigger on idem_processed_events
// that fails once; in production e.g. 54000 "database is not accepting
// commands that assign new transaction IDs", the wraparound stop) must not
// dead-letter a valid record on its first attempt: its id ("t1", ASCII and
// short) cannot be what PostgreSQL refused. With a budget of 3 the second
// attempt applies it.
func TestRevrtDedupeDataErrorNotCausedByIDUsesBudget(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"22021", "22P05", "54000"} {
		t.Run(code, func(t *testing.T) {
			t.Parallel()
			pool, store := consumeDB(t)
			pgtest.Exec(t, pool, `CREATE SEQUENCE flaky_seq;
CREATE FUNCTION flaky_dedupe() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('flaky_seq') = 1 THEN -- a sequence is not rolled back: fails the first insert only
        RAISE EXCEPTION 'refused once, not for the id' USING ERRCODE = '`+code+`';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER flaky BEFORE INSERT ON idem_processed_events FOR EACH ROW EXECUTE FUNCTION flaky_dedupe()`)
			p := processor(t, store, 3)
			var calls atomic.Int64
			h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
				calls.Add(1)
				return insertEffect(ctx, tx, e)
			})
			o := processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"t1","amount":1}`)})
			if o != idem.Applied {
				var last string
				_ = pool.QueryRow(context.Background(), `SELECT last_error FROM idem_dead_letters`).Scan(&last)
				t.Fatalf("outcome %v (dead letter: %q); want applied on the second attempt", o, last)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 || calls.Load() != 1 {
				t.Fatalf("%d effects, %d handler calls; want 1 and 1", n, calls.Load())
			}
		})
	}
}

// Outside review (revrt). A cancellation while the COMMIT is in flight (here
// a deferred trigger makes the COMMIT take 3s; the processor abandons it
// commitGrace after the cancellation, and pgx closes the connection) is
// returned as the context's error, not retried as an outage now that a
// COMMIT on a closed connection is one.
func TestRevrtCancelDuringCommitIsReturned(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	pgtest.Exec(t, pool, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	p := processor(t, store, 3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
		if err := insertEffect(ctx, tx, e); err != nil {
			return err
		}
		time.AfterFunc(200*time.Millisecond, cancel) // once the COMMIT is on its way
		return nil
	})
	done := make(chan error, 1)
	go func() {
		_, err := p.Process(ctx, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"c1","amount":1}`)})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Process = %v; want context.Canceled", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Process did not return 20s after its context was cancelled during COMMIT")
	}
}
