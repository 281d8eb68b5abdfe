package admin_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

// TestReplayCancelledAfterAck: the context is cancelled (an operator's
// Ctrl-C) right after the broker acked the re-produced record, before the
// mark's commit. The record is out, so the mark must be committed all the
// same: the commit ran on the cancelled context, failed, rolled the mark
// back, and the dead letter stayed unreplayed although its record had been
// produced, so the operator replayed it again.
func TestReplayCancelledAfterAck(t *testing.T) {
	pool := migrated(t, nil)
	pgtest.Exec(t, pool, `INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', ARRAY['idem-event-id'::bytea], ARRAY['ev-7'::bytea], 5, 'boom')`)
	id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	produced := 0
	ok, err := admin.New(pool).ReplayDeadLetter(ctx, id, func(context.Context, admin.DeadLetter) error {
		produced++
		cancel() // the broker acked; Ctrl-C comes now
		return nil
	})
	if !ok || err != nil || produced != 1 {
		t.Fatalf("replay cancelled after the ack: %v, %v, %d produces; want replayed (true, nil, 1)", ok, err, produced)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Error("the dead letter whose record was produced is not marked replayed")
	}
}

// TestReplayMarkFailsAfterAck: the mark's commit fails after the broker
// acked (the database connection is gone). The error says that the record
// WAS produced and the dead letter NOT marked (ErrProducedNotMarked), and
// a second replay, which produces the record again, is a duplicate for the
// consumer that applied the first copy: the processed-event row of its
// event id (what the README tells the operator).
func TestReplayMarkFailsAfterAck(t *testing.T) {
	app := "admin-markfail-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	pool := migrated(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	pgtest.Exec(t, pool, `INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', '{"n":1}', ARRAY['idem-event-id'::bytea], ARRAY['ev-7'::bytea], 5, 'boom')`)
	id := pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
	a := admin.New(pool)
	ctx := context.Background()

	var copies []admin.DeadLetter
	ok, err := a.ReplayDeadLetter(ctx, id, func(_ context.Context, d admin.DeadLetter) error {
		copies = append(copies, d)
		// The broker acks; the replay's connection, idle in its transaction
		// with the mark written, is lost before the commit.
		conn, err := pgx.Connect(ctx, pgtest.BaseURL())
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, app).Scan(&n); err != nil || n != 1 {
			t.Errorf("terminate the replay's connection: %d terminated, %v", n, err)
		}
		return nil
	})
	if ok || !errors.Is(err, admin.ErrProducedNotMarked) {
		t.Fatalf("mark lost after the ack: %v, %v; want ErrProducedNotMarked", ok, err)
	}
	for _, w := range []string{"WAS produced", "NOT marked replayed", `"orders"`} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not say %q", err, w)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`); n != 1 {
		t.Fatalf("%d unreplayed dead letters, want 1 (the mark's commit failed)", n)
	}

	// The operator replays it again: a second copy goes out.
	ok, err = a.ReplayDeadLetter(ctx, id, func(_ context.Context, d admin.DeadLetter) error {
		copies = append(copies, d)
		return nil
	})
	if !ok || err != nil || len(copies) != 2 {
		t.Fatalf("second replay: %v, %v, %d copies produced", ok, err, len(copies))
	}

	// The failed context consumes both copies: the first is applied, the
	// second skipped by its event id.
	p, err := idem.NewProcessor(idem.NewStore(pool), idem.ProcessorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var applied atomic.Int32
	h := idem.Consume(idem.EventSpec[struct{ N int }]{Topic: "orders", Context: "billing"},
		func(context.Context, pgx.Tx, struct{ N int }) error { applied.Add(1); return nil })
	var outcomes []idem.Outcome
	for i, d := range copies {
		rec := &idem.Record{Topic: d.Topic, Partition: 0, Offset: int64(100 + i), Key: d.Key, Value: d.Value}
		for _, hd := range d.Headers {
			rec.Headers = append(rec.Headers, idem.RecordHeader{Key: hd.Key, Value: hd.Value})
		}
		o, err := p.Process(ctx, &h, rec)
		if err != nil {
			t.Fatal(err)
		}
		outcomes = append(outcomes, o)
	}
	if outcomes[0] != idem.Applied || outcomes[1] != idem.Duplicate || applied.Load() != 1 {
		t.Errorf("the two replayed copies: %v, handler ran %d times; want applied, duplicate, once", outcomes, applied.Load())
	}
}

// TestDeadLetterUnpairedHeaders: a row whose header name and value arrays
// differ in length (edited by hand: the runtime writes them in pairs) is
// shown with what can be paired and the rest, not refused: DeadLetter
// failed with "2 header names for 1 values", and idemctl could neither
// show nor dry-run discard it. Its replay is refused before anything is
// produced.
func TestDeadLetterUnpairedHeaders(t *testing.T) {
	pool := migrated(t, nil)
	pgtest.Exec(t, pool, `INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, header_keys, header_values, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', ARRAY['idem-event-id'::bytea, 'trace'::bytea], ARRAY['ev-7'::bytea], 5, 'boom'),
       ('billing', 'orders', 0, 8, 'k', 'v', ARRAY['idem-event-id'::bytea], ARRAY['ev-8'::bytea, 'x'::bytea, NULL], 5, 'boom')`)
	a := admin.New(pool)
	ctx := context.Background()
	first := pgtest.Count(t, pool, `SELECT min(id) FROM idem_dead_letters`)

	d, err := a.DeadLetter(ctx, first)
	if err != nil {
		t.Fatalf("a dead letter with more header names than values: %v", err)
	}
	if !d.HeadersDamaged() || len(d.Headers) != 1 || d.Headers[0].Key != "idem-event-id" || string(d.Headers[0].Value) != "ev-7" ||
		len(d.UnpairedHeaderKeys) != 1 || d.UnpairedHeaderKeys[0] != "trace" || d.UnpairedHeaderValues != nil {
		t.Errorf("more names than values: headers %q, unpaired names %q, values %q", d.Headers, d.UnpairedHeaderKeys, d.UnpairedHeaderValues)
	}
	d, err = a.DeadLetter(ctx, first+1)
	if err != nil {
		t.Fatalf("a dead letter with more header values than names: %v", err)
	}
	if !d.HeadersDamaged() || len(d.Headers) != 1 || len(d.UnpairedHeaderKeys) != 0 ||
		len(d.UnpairedHeaderValues) != 2 || string(d.UnpairedHeaderValues[0]) != "x" || d.UnpairedHeaderValues[1] != nil {
		t.Errorf("more values than names: headers %q, unpaired names %q, values %q", d.Headers, d.UnpairedHeaderKeys, d.UnpairedHeaderValues)
	}

	produced := 0
	ok, err := a.ReplayDeadLetter(ctx, first, func(context.Context, admin.DeadLetter) error { produced++; return nil })
	if ok || !errors.Is(err, admin.ErrUnpairedHeaders) || produced != 0 {
		t.Errorf("replaying it: %v, %v, %d produces; want ErrUnpairedHeaders and nothing produced", ok, err, produced)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`); n != 2 {
		t.Errorf("%d unreplayed, want 2", n)
	}
}
