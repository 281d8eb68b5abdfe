package idem_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Issue 11: a replay is a read. The claim used to lock the live row (ON
// CONFLICT DO UPDATE … WHERE expired locks it even when the WHERE fails):
// a transaction id, WAL, and replays of one key serialised on the row lock.
// Now a replay leaves the row untouched (xmax stays 0) and is answered even
// while something else holds the row locked.
func TestReplayIsARead(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{Wait: 2 * time.Second})
	first := do(h, "k-read", body1)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	for range 3 {
		if r := do(h, "k-read", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("replay: %d %s", r.status, r.body)
		}
	}
	// A lock or an update by a replay would have left its transaction id
	// in the row's xmax (even once rolled back).
	var xmax string
	if err := e.pool.QueryRow(context.Background(), `SELECT xmax::text FROM idem_keys WHERE key = 'k-read'`).Scan(&xmax); err != nil {
		t.Fatal(err)
	}
	if xmax != "0" {
		t.Fatalf("replays locked or wrote the key row: xmax %s, want 0", xmax)
	}

	// With the row locked by another transaction, a replay (a read) is
	// answered at once instead of waiting out the 2s bound and failing.
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM idem_keys WHERE key = 'k-read' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	if r := do(h, "k-read", body1); r.status != http.StatusCreated || string(r.body) != string(first.body) {
		t.Fatalf("replay while the row is locked: %d %s, want the stored 201", r.status, r.body)
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("function ran %d times, want 1", n)
	}
}

// Issue 11: an expired key is still taken over (the claim no longer does it
// in ON CONFLICT), once: the function runs again and the new response is
// stored and replayed.
func TestExpiredKeyTakenOverOnce(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{})
	if r := do(h, "k-exp", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	pgtest.Exec(t, e.pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE key = 'k-exp'`)
	again := do(h, "k-exp", body1)
	if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("expired key: %d replayed=%q", again.status, again.header.Get("Idempotent-Replayed"))
	}
	replay := do(h, "k-exp", body1)
	if replay.header.Get("Idempotent-Replayed") != "true" || string(replay.body) != string(again.body) {
		t.Fatalf("after the takeover: %d %s, want a replay of %s", replay.status, replay.body, again.body)
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("function ran %d times, want 2", n)
	}
}

// Issue 11: round trips counted on the wire (pgx's statement cache warm). A
// first request costs BEGIN (with its settings) │ the claim batch │ the
// function's INSERT │ CompleteKey with COMMIT: 4, down from 5. A replay
// costs BEGIN │ the claim batch │ ROLLBACK, the last after the response.
// The minimum over a few requests is taken: a pool may ping a connection
// that sat idle, which is not the request's cost.
func TestRoundTripsOnTheWire(t *testing.T) {
	t.Parallel()
	var rt benchkit.RoundTrips
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1; c.ConnConfig.DialFunc = rt.Dial })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	h := e.handler(idem.Endpoint{})
	idle := func() { // wait for a background ROLLBACK: the pool's one connection is free again
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		c.Release()
	}
	// Warm the statement cache; an idle acquire must cost nothing on the
	// wire, or the counts below would include it.
	do(h, "k-rt-warm", body1)
	do(h, "k-rt-warm", body1)
	idle()
	before := rt.Count()
	idle()
	if n := rt.Count() - before; n != 0 {
		t.Fatalf("an idle acquire cost %d round trips", n)
	}
	first := minTrips(t, &rt, idle, func(i int) { do(h, "k-rt-"+string(rune('a'+i)), body1) })
	replay := minTrips(t, &rt, idle, func(int) { do(h, "k-rt-warm", body1) })
	if first != 4 {
		t.Errorf("first request: %d round trips, want 4", first)
	}
	if replay != 3 {
		t.Errorf("replay: %d round trips (the last one after the response), want 3", replay)
	}
}

// minTrips is the fewest round trips one call of op cost over 5 calls,
// each followed by idle (which waits for background work and costs none).
func minTrips(t *testing.T, rt *benchkit.RoundTrips, idle func(), op func(int)) int64 {
	t.Helper()
	best := int64(1 << 30)
	for i := range 5 {
		before := rt.Count()
		op(i)
		idle()
		best = min(best, rt.Count()-before)
	}
	return best
}

// Issue 11: the response is stored and the transaction committed in one
// round trip. A COMMIT that fails there (a deferred constraint) commits
// nothing, answers a failure, and leaves the connection usable: the retry
// runs the function again.
func TestCommitFailureInPipeline(t *testing.T) {
	e := newEnv(t)
	pgtest.Exec(t, e.pool, `CREATE TABLE parent (id int PRIMARY KEY);
		CREATE TABLE child (parent_id int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`)
	e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
		if req.Amount == 100 { // body1: violates the deferred FK at COMMIT
			_, err := tx.Exec(ctx, `INSERT INTO child VALUES (999)`)
			return err
		}
		return nil
	}
	h := e.handler(idem.Endpoint{})
	if r := do(h, "k-commit", body1); r.status < 500 {
		t.Fatalf("commit refused: %d %s, want a 5xx", r.status, r.body)
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("after a failed COMMIT: %d effects, %d keys, want none", e.effects(), e.keys())
	}
	e.hook = nil
	r := do(h, "k-commit", body1)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s", r.status, r.body)
	}
	if e.calls.Load() != 2 || e.effects() != 1 || e.keys() != 1 {
		t.Fatalf("retry: %d calls, %d effects, %d keys, want 2, 1, 1", e.calls.Load(), e.effects(), e.keys())
	}
}

// Issue 11: outbox event ids are time-ordered (UUIDv7), so the claim and
// mark UPDATEs write their event_id index entries on the index's rightmost
// pages, not all over a history of random UUIDs; an outbox created with the
// random default gets the new one from Migrate.
func TestOutboxEventIDsTimeOrdered(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	enqueueAndCheck := func(n int) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for i := range n {
				if err := idem.Enqueue(ctx, tx, "events", "k", map[string]int{"i": i}); err != nil {
					return err
				}
				time.Sleep(2 * time.Millisecond) // a new millisecond prefix
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		rows, err := pool.Query(ctx, `SELECT event_id FROM idem_outbox ORDER BY id DESC LIMIT $1`, n)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		for i, id := range ids {
			if len(id) != 36 || id[14] != '7' {
				t.Fatalf("event id %q is not a UUIDv7", id)
			}
			if i > 0 && id[:13] >= ids[i-1][:13] { // newest first: the time prefix decreases
				t.Fatalf("event ids not time-ordered: %q enqueued before %q", id, ids[i-1])
			}
		}
	}
	enqueueAndCheck(5)

	pgtest.Exec(t, pool, `ALTER TABLE idem_outbox ALTER COLUMN event_id SET DEFAULT gen_random_uuid()::text;
		DELETE FROM idem_schema_version`)
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	enqueueAndCheck(3)
}
