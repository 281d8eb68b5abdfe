package admin_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
	"github.com/idemgen/idemgen/runtime/idem"
)

// parkSome acks every message but "bad" (a permanent error: parked at
// once) and "flaky" (a failure of its own, others of the batch got
// through: counted, parked at MaxAttempts).
type parkSome struct{}

func (parkSome) Publish(_ context.Context, msgs []idem.Message) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		switch string(m.Key) {
		case "bad":
			errs[i] = idem.Permanent(errors.New("record too large"))
		case "flaky":
			errs[i] = errors.New("not leader for partition")
		}
	}
	return errs
}

// TestPurgeParkedByParkingTime: the relay's parking sets parked_at (both
// ways a row is parked: a permanent error and the last counted attempt),
// and a purge of parked rows goes by it. Events enqueued ten days ago and
// parked just now survive a purge of rows parked more than 7 days ago (it
// went by created_at and deleted them: their events were lost); a row
// parked ten days ago is deleted; a row parked by a version without
// parked_at (NULL) is kept and counted, and can be purged by id. A requeue
// clears parked_at, through either requeue path.
//
// It runs twice: as migrated, and with the trigger idem_outbox_parked_at
// disabled. That trigger gives a parking time to a row an older version's
// statement parks, and would give one as well to a row this version's
// statements parked without setting parked_at: run only with it, the test
// passed with MarkOutboxFailed and the requeues not naming parked_at at
// all. Without it, the parking time must come from those statements, as
// the trigger's WHEN clause (which skips them) takes for granted.
func TestPurgeParkedByParkingTime(t *testing.T) {
	t.Parallel()
	for _, trigger := range []bool{true, false} {
		t.Run(fmt.Sprintf("trigger=%v", trigger), func(t *testing.T) {
			t.Parallel()
			testPurgeParkedByParkingTime(t, trigger)
		})
	}
}

func testPurgeParkedByParkingTime(t *testing.T, trigger bool) {
	pool := migrated(t, nil)
	ctx := context.Background()
	if !trigger {
		pgtest.Exec(t, pool, `ALTER TABLE idem_outbox DISABLE TRIGGER idem_outbox_parked_at`)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, key := range []string{"a", "bad", "flaky", "c"} {
			if err := idem.Enqueue(ctx, tx, "t", key, map[string]string{"k": key}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `
UPDATE idem_outbox SET created_at = now() - interval '10 days';
INSERT INTO idem_outbox (topic, record_key, payload, status, attempts, last_error, created_at, parked_at)
VALUES ('t', 'parked-long-ago', '', 'PARKED', 10, 'x', now() - interval '10 days', now() - interval '10 days'),
       ('t', 'parked-by-old-version', '', 'PARKED', 10, 'x', now() - interval '10 days', NULL);`)
	id := func(key string) int64 {
		t.Helper()
		var id int64
		if err := pool.QueryRow(ctx, `SELECT id FROM idem_outbox WHERE record_key = $1`, key).Scan(&id); err != nil {
			t.Fatalf("row %s: %v", key, err)
		}
		return id
	}

	var dbStart time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&dbStart); err != nil {
		t.Fatal(err)
	}
	relay, err := idem.NewRelay(idem.NewStore(pool), parkSome{}, idem.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status IN ('PUBLISHED', 'PARKED') AND record_key IN ('a', 'bad', 'flaky', 'c')`) != 4 {
		if time.Now().After(deadline) {
			t.Fatal("the relay did not publish a, c and park bad, flaky in 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT record_key, status, parked_at IS NOT NULL, coalesce(parked_at >= $1 AND parked_at <= now(), false)
		FROM idem_outbox WHERE record_key IN ('a', 'bad', 'flaky', 'c') ORDER BY id`, dbStart)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var key []byte
		var status string
		var hasParkedAt, recent bool
		if err := rows.Scan(&key, &status, &hasParkedAt, &recent); err != nil {
			t.Fatal(err)
		}
		switch string(key) {
		case "bad", "flaky":
			if status != "PARKED" || !hasParkedAt || !recent {
				t.Errorf("%s: %s, parked_at set %v, since the relay started %v; want PARKED with parked_at of its parking", key, status, hasParkedAt, recent)
			}
		default:
			if status != "PUBLISHED" || hasParkedAt {
				t.Errorf("%s: %s, parked_at set %v; want PUBLISHED without parked_at", key, status, hasParkedAt)
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	a := admin.New(pool)
	evs, err := a.ParkedEvents(ctx, admin.OutboxFilter{}, 10)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range evs {
		if unknown := e.ParkedAt.IsZero(); unknown != (string(e.Key) == "parked-by-old-version") {
			t.Errorf("listed %s with ParkedAt %v", e.Key, e.ParkedAt)
		}
	}

	weekAgo := time.Now().Add(-7 * 24 * time.Hour)
	if n, err := a.CountOutboxBefore(ctx, admin.StatusParked, weekAgo); err != nil || n != 1 {
		t.Errorf("dry run counts %d rows parked a week ago (%v), want 1", n, err)
	}
	if n, err := a.CountParkedUnknownTime(ctx); err != nil || n != 1 {
		t.Errorf("%d parked rows without a parking time (%v), want 1", n, err)
	}
	if n, err := a.PurgeOutbox(ctx, admin.StatusParked, weekAgo, 1000); err != nil || n != 1 {
		t.Errorf("purge of rows parked a week ago deleted %d (%v), want 1", n, err)
	}
	var left []string
	rows, err = pool.Query(ctx, `SELECT convert_from(record_key, 'UTF8') FROM idem_outbox WHERE status = 'PARKED' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"bad", "flaky", "parked-by-old-version"}; !equal(left, want) {
		t.Fatalf("parked rows left: %q, want %q (only the row parked ten days ago purged)", left, want)
	}

	// The row of unknown parking time goes by id, once.
	old := id("parked-by-old-version")
	if n, err := a.PurgeParked(ctx, old); err != nil || n != 1 {
		t.Errorf("purge by id deleted %d (%v), want 1", n, err)
	}
	if n, err := a.PurgeParked(ctx, old); err != nil || n != 0 {
		t.Errorf("purge by id again deleted %d (%v), want 0", n, err)
	}
	if n, err := a.PurgeParked(ctx, id("a")); err != nil || n != 0 {
		t.Errorf("purge by id of a PUBLISHED row deleted %d (%v), want 0", n, err)
	}

	// Both requeue paths clear parked_at.
	if n, err := idem.NewStore(pool).RequeueParked(ctx, id("bad")); err != nil || n != 1 {
		t.Fatalf("requeue bad: %d, %v", n, err)
	}
	if n, _, err := a.RequeueParkedBatch(ctx, admin.OutboxFilter{Topic: "t"}, 10); err != nil || n != 1 {
		t.Fatalf("requeue flaky: %d, %v", n, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PENDING' AND parked_at IS NULL AND record_key IN ('bad', 'flaky')`); n != 2 {
		t.Errorf("%d of 2 requeued rows PENDING with parked_at cleared", n)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
