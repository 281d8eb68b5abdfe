package idem_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

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
