package idem_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// An event id holding a NUL byte is dead-lettered at once, before any SQL,
// whatever the pool's exec mode, in both the per-record and the batch path.
// With QueryExecModeSimpleProtocol pgx inlines the id into the pipeline's
// query string, where the NUL broke the protocol message: PostgreSQL
// answered 08P01 "invalid message format", which is an outage, so the
// record was waited out forever and its partition never moved on. (With
// the other modes it failed the dedupe insert with 22021 and was retried
// through the whole budget, for an id that can never be stored.)
func TestNULEventIDRefusedBeforeSQL(t *testing.T) {
	t.Parallel()
	modes := []struct {
		name string
		mode pgx.QueryExecMode
	}{
		{"simple protocol", pgx.QueryExecModeSimpleProtocol},
		{"exec", pgx.QueryExecModeExec},
		{"cache statement", pgx.QueryExecModeCacheStatement},
	}
	for _, m := range modes {
		for _, batch := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/batch=%v", m.name, batch), func(t *testing.T) {
				t.Parallel()
				pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
					c.MaxConns = 2
					c.ConnConfig.DefaultQueryExecMode = m.mode
				})
				if err := idem.Migrate(context.Background(), pool); err != nil {
					t.Fatal(err)
				}
				pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
				store := idem.NewStore(pool)
				p := processor(t, store, 3)
				// The id from the header (raw bytes) and from a field (JSON's \u0000).
				fromHeader := idem.Consume(idem.EventSpec[event]{Topic: "events", Context: "header"},
					func(ctx context.Context, tx pgx.Tx, e event) error {
						_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ('header', $1)`, e.Amount)
						return err
					})
				fromField := handler(insertEffect)
				recs := []*idem.Record{
					{Topic: "events", Offset: 0, Value: []byte(`{"id":"before","amount":1}`),
						Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte("before")}}},
					{Topic: "events", Offset: 1, Key: []byte("k\x00"), Value: []byte(`{"id":"a\u0000b","amount":1}`),
						Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte("a\x00b")}}},
					{Topic: "events", Offset: 2, Value: []byte(`{"id":"after","amount":1}`),
						Headers: []idem.RecordHeader{{Key: idem.EventIDHeader, Value: []byte("after")}}},
				}
				want := []idem.Outcome{idem.Applied, idem.DeadLettered, idem.Applied}
				for _, h := range []*idem.EventHandler{&fromHeader, &fromField} {
					// Bounded: on the old code the simple-protocol record
					// never ended.
					ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
					var got []idem.Outcome
					if batch {
						var err error
						if got, err = p.ProcessBatch(ctx, h, recs); err != nil {
							cancel()
							t.Fatalf("%s: ProcessBatch: %v (outcomes %v)", h.Context, err, got)
						}
					} else {
						for _, rec := range recs {
							o, err := p.Process(ctx, h, rec)
							if err != nil {
								cancel()
								t.Fatalf("%s: Process(offset %d): %v", h.Context, rec.Offset, err)
							}
							got = append(got, o)
						}
					}
					cancel()
					if fmt.Sprint(got) != fmt.Sprint(want) {
						t.Fatalf("%s: outcomes %v, want %v", h.Context, got, want)
					}
				}
				var ids []int64
				rows, err := pool.Query(context.Background(), `SELECT id FROM idem_dead_letters ORDER BY id`)
				if err != nil {
					t.Fatal(err)
				}
				if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil || len(ids) != 2 {
					t.Fatalf("dead letters %v (%v), want 2", ids, err)
				}
				for _, id := range ids {
					dl, err := store.DeadLetter(context.Background(), id)
					if err != nil {
						t.Fatal(err)
					}
					// At once, with the raw bytes: the id can never be stored.
					if dl.Attempts != 1 || !strings.Contains(dl.LastError, "NUL byte") || dl.Record.Offset != 1 ||
						!bytes.Equal(dl.Record.Key, recs[1].Key) || !bytes.Equal(dl.Record.Headers[0].Value, []byte("a\x00b")) {
						t.Fatalf("dead letter %d: attempts %d, error %q, offset %d, key %q, headers %q; want 1 attempt refusing the NUL",
							id, dl.Attempts, dl.LastError, dl.Record.Offset, dl.Record.Key, dl.Record.Headers)
					}
				}
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 4 {
					t.Fatalf("%d processed events, want 4 (before and after, per context)", n)
				}
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 4 {
					t.Fatalf("%d effects, want 4", n)
				}
			})
		}
	}
}

// unindexableID is an event id PostgreSQL refuses in the processed-event
// index: 3200 bytes that do not compress (54000, the index row over 2704
// bytes), while a NUL is refused before any SQL.
func unindexableID() string {
	b := make([]byte, 1600)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// An IdleInTransactionTimeout over PostgreSQL's maximum (INT_MAX ms, about
// 24.8 days) is refused by NewProcessor. It was accepted, and then the
// setting sent with every BEGIN failed with 22023, a data exception, which
// the processor takes for the record's failure: every record, valid ones
// included, was retried through its budget and dead-lettered. The maximum
// itself is accepted, and PostgreSQL takes it.
func TestIdleInTransactionTimeoutOverPostgresMaximum(t *testing.T) {
	t.Parallel()
	pool, store := consumeDB(t)
	const pgMax = 2147483647 * time.Millisecond
	for _, d := range []time.Duration{pgMax + time.Millisecond, 30 * 24 * time.Hour} {
		if _, err := idem.NewProcessor(store, idem.ProcessorConfig{IdleInTransactionTimeout: d}); err == nil {
			t.Errorf("NewProcessor accepted IdleInTransactionTimeout %v, over PostgreSQL's maximum", d)
		}
	}
	p, err := idem.NewProcessor(store, idem.ProcessorConfig{
		IdleInTransactionTimeout: pgMax,
		Retry:                    idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond},
	})
	if err != nil {
		t.Fatalf("NewProcessor refused PostgreSQL's maximum: %v", err)
	}
	h := handler(insertEffect)
	if o := processBounded(t, p, &h, &idem.Record{Topic: "events", Value: []byte(`{"id":"e1","amount":1}`)}); o != idem.Applied {
		t.Fatalf("outcome %v with IdleInTransactionTimeout at PostgreSQL's maximum, want applied", o)
	}
	recs := []*idem.Record{
		{Topic: "events", Offset: 1, Value: []byte(`{"id":"e2","amount":1}`)},
		{Topic: "events", Offset: 2, Value: []byte(`{"id":"e3","amount":1}`)},
	}
	if got, err := p.ProcessBatch(context.Background(), &h, recs); err != nil || fmt.Sprint(got) != "[applied applied]" {
		t.Fatalf("batch: %v, %v; want both applied", got, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 3 {
		t.Fatalf("%d effects, want 3", n)
	}
}

// A handler that leaves its transaction's connection busy — a Rows not
// closed, a QueryRow not scanned — fails every statement after it with
// pgconn's "conn busy", which pgconn calls safe to retry. That is the
// handler's doing and recurs on every attempt: it is the record's failure,
// dead-lettered after the budget, never an outage. It was waited out
// forever ("storage unavailable" at COMMIT, or the handler's own next
// statement), the handler re-run on every try and the partition stuck. In
// a batch, only the record whose handler left the connection busy is
// charged: the records after it are applied even with a budget of one.
func TestHandlerLeavingConnBusyIsRecordFailure(t *testing.T) {
	t.Parallel()
	cases := map[string]func(ctx context.Context, tx pgx.Tx) error{
		// Returns nil: the COMMIT finds the connection busy.
		"rows left open": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Query(ctx, `SELECT generate_series(1, 10)`)
			return err
		},
		// Its own next statement finds the connection busy.
		"statement after open rows": func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Query(ctx, `SELECT 1`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT 2`)
			return err
		},
		"row not scanned": func(ctx context.Context, tx pgx.Tx) error {
			tx.QueryRow(ctx, `SELECT 1`)
			return nil
		},
	}
	for name, leak := range cases {
		for _, batch := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/batch=%v", name, batch), func(t *testing.T) {
				t.Parallel()
				pool, store := consumeDB(t)
				p := processor(t, store, 1)
				h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
					if err := insertEffect(ctx, tx, e); err != nil {
						return err
					}
					if *e.ID == "leaky" {
						return leak(ctx, tx)
					}
					return nil
				})
				recs := []*idem.Record{
					{Topic: "events", Offset: 0, Value: []byte(`{"id":"before","amount":1}`)},
					{Topic: "events", Offset: 1, Value: []byte(`{"id":"leaky","amount":1}`)},
					{Topic: "events", Offset: 2, Value: []byte(`{"id":"after","amount":1}`)},
				}
				// Bounded: on the old code the leaky record never ended.
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				var got []idem.Outcome
				if batch {
					var err error
					if got, err = p.ProcessBatch(ctx, &h, recs); err != nil {
						t.Fatalf("ProcessBatch: %v (outcomes %v)", err, got)
					}
				} else {
					for _, rec := range recs {
						o, err := p.Process(ctx, &h, rec)
						if err != nil {
							t.Fatalf("Process(offset %d): %v", rec.Offset, err)
						}
						got = append(got, o)
					}
				}
				if want := "[applied dead-lettered applied]"; fmt.Sprint(got) != want {
					t.Fatalf("outcomes %v, want %s", got, want)
				}
				dl, err := store.DeadLetter(context.Background(), 1)
				if err != nil {
					t.Fatal(err)
				}
				if dl.Record.Offset != 1 || dl.Attempts != 1 || !strings.Contains(dl.LastError, "busy") {
					t.Fatalf("dead letter: offset %d, attempts %d, error %q", dl.Record.Offset, dl.Attempts, dl.LastError)
				}
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 1 {
					t.Fatalf("%d dead letters, want 1", n)
				}
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id <> 'leaky'`); n != 2 {
					t.Fatalf("%d effects of the other records, want 2", n)
				}
				if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'leaky'`); n != 0 {
					t.Fatalf("the leaky record's effect committed %d times", n)
				}
			})
		}
	}
}

// A handler that rolls its transaction back itself and returns nil — with a
// ROLLBACK or ABORT statement, or tx.Rollback — is the record's failure.
// After a ROLLBACK statement nothing was left to commit, not the effect nor
// the processed-event row, yet the COMMIT that followed "succeeded"
// (PostgreSQL only warns that no transaction is in progress): the record
// was reported applied with nothing stored, its offset would be marked and
// the event lost. In a batch the next records' handlers then ran outside
// any transaction, their effects autocommitted without processed-event
// rows (applied again on redelivery); with tx.Rollback, the next record's
// handler failed on the closed transaction and was charged for it. Now
// only the record that ended its transaction is dead-lettered; the others
// are applied once.
func TestHandlerEndingItsTransactionIsRecordFailure(t *testing.T) {
	t.Parallel()
	cases := map[string]func(ctx context.Context, tx pgx.Tx) error{
		"ROLLBACK statement": func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, `ROLLBACK`); return err },
		"ABORT statement":    func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, `ABORT`); return err },
		"tx.Rollback":        func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
		// A new transaction afterwards: the connection is in a transaction
		// again, so only CheckOwnTransaction, sent with the COMMIT, can
		// tell (final review; reported applied, the event lost, before).
		"ROLLBACK AND CHAIN": func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, `ROLLBACK AND CHAIN`); return err },
		"ROLLBACK then BEGIN": func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `ROLLBACK`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `BEGIN`)
			return err
		},
	}
	for name, end := range cases {
		for _, batch := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/batch=%v", name, batch), func(t *testing.T) {
				t.Parallel()
				pool, store := consumeDB(t)
				p := processor(t, store, 1)
				h := handler(func(ctx context.Context, tx pgx.Tx, e event) error {
					if err := insertEffect(ctx, tx, e); err != nil {
						return err
					}
					if *e.ID == "ender" {
						return end(ctx, tx)
					}
					return nil
				})
				recs := []*idem.Record{
					{Topic: "events", Offset: 0, Value: []byte(`{"id":"before","amount":1}`)},
					{Topic: "events", Offset: 1, Value: []byte(`{"id":"ender","amount":1}`)},
					{Topic: "events", Offset: 2, Value: []byte(`{"id":"after","amount":1}`)},
				}
				// Twice: the second run is a redelivery, which must add nothing.
				for round := range 2 {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					var got []idem.Outcome
					if batch {
						var err error
						if got, err = p.ProcessBatch(ctx, &h, recs); err != nil {
							cancel()
							t.Fatalf("ProcessBatch: %v (outcomes %v)", err, got)
						}
					} else {
						for _, rec := range recs {
							o, err := p.Process(ctx, &h, rec)
							if err != nil {
								cancel()
								t.Fatalf("Process(offset %d): %v", rec.Offset, err)
							}
							got = append(got, o)
						}
					}
					cancel()
					want := "[applied dead-lettered applied]"
					if round == 1 {
						want = "[duplicate dead-lettered duplicate]"
					}
					if fmt.Sprint(got) != want {
						t.Fatalf("round %d: outcomes %v, want %s", round, got, want)
					}
				}
				dl, err := store.DeadLetter(context.Background(), 1)
				if err != nil {
					t.Fatal(err)
				}
				if dl.Record.Offset != 1 || !strings.Contains(dl.LastError, "ended its transaction") {
					t.Fatalf("dead letter: offset %d, error %q", dl.Record.Offset, dl.LastError)
				}
				for id, want := range map[string]int64{"before": 1, "ender": 0, "after": 1} {
					if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE event_id = $1`, id); n != want {
						t.Errorf("%d effects of %s, want %d", n, id, want)
					}
					if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_processed_events WHERE event_id = $1`, id); n != want {
						t.Errorf("%d processed events of %s, want %d", n, id, want)
					}
				}
			})
		}
	}
}
