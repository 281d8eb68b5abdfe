package idem_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
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
// first request costs BEGIN with its settings and the claim, pipelined │
// the function's INSERT │ StoreKey with COMMIT: 3, the bare handler's
// count (it was 5, then 4 with BEGIN on its own). A replay costs the same
// first round trip, after which the client has its answer, and the
// ROLLBACK sent after the response: 2 (was 3). A request without a key
// (KeyOptional) costs BEGIN with its settings │ the INSERT │ COMMIT: 3.
// A custom BeginQuery, which may hold several statements, cannot be
// pipelined: BEGIN goes on its own and a first request costs 4.
// The rare takeover of an expired key costs one more round trip before the
// function, which locks the expired row (see
// TestFirstRequestLocksNoRow): 4, or 5 with a custom BeginQuery.
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
	if first != 3 {
		t.Errorf("first request: %d round trips, want 3", first)
	}
	if replay != 2 {
		t.Errorf("replay: %d round trips (the last one after the response), want 2", replay)
	}
	// takeovers is the fewest round trips a takeover of key costs over 5,
	// each of the key completed and then expired (outside the count).
	takeovers := func(h http.Handler, key string) int64 {
		best := int64(1 << 30)
		for range 5 {
			pgtest.Exec(t, pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE key = '`+key+`'`)
			idle()
			before := rt.Count()
			if r := do(h, key, body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("takeover of %s: %d %s", key, r.status, r.body)
			}
			idle()
			best = min(best, rt.Count()-before)
		}
		return best
	}
	if takeover := takeovers(h, "k-rt-warm"); takeover != 4 {
		t.Errorf("takeover of an expired key: %d round trips, want 4", takeover)
	}

	noKey := e.handlerWith(idem.Endpoint{KeyOptional: true}, nil)
	do(noKey, "", body1)
	if n := minTrips(t, &rt, idle, func(int) { do(noKey, "", body1) }); n != 3 {
		t.Errorf("request without a key: %d round trips, want 3", n)
	}

	// A custom BeginQuery still works, begun on its own.
	custom := e.handlerWith(idem.Endpoint{Scope: "test.custom"}, func(c *idem.HTTPConfig) {
		c.TxOptions = pgx.TxOptions{BeginQuery: "begin isolation level repeatable read; set local statement_timeout = '5s'"}
	})
	do(custom, "k-rt-custom-warm", body1)
	if n := minTrips(t, &rt, idle, func(i int) { do(custom, "k-rt-custom-"+string(rune('a'+i)), body1) }); n != 4 {
		t.Errorf("first request with a custom BeginQuery: %d round trips, want 4", n)
	}
	if r := do(custom, "k-rt-custom-a", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("replay with a custom BeginQuery: %d %s", r.status, r.body)
	}
	if n := takeovers(custom, "k-rt-custom-a"); n != 5 {
		t.Errorf("takeover of an expired key with a custom BeginQuery: %d round trips, want 5", n)
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

// handlerWith is e.handler(ep) on an engine whose config is e.cfg changed
// by mod (nil: unchanged); e.cfg itself is left as it was.
func (e *env) handlerWith(ep idem.Endpoint, mod func(*idem.HTTPConfig)) http.Handler {
	saved := e.cfg
	defer func() { e.cfg = saved }()
	if mod != nil {
		mod(&e.cfg)
	}
	return e.handler(ep)
}

// Issue 11: BEGIN, the settings and the claim go in one pipelined round
// trip. When the claim fails in that batch (here it waits for a table lock
// past the wait bound: lock_timeout, a 503), the aborted transaction is
// rolled back and the connection goes back to the pool clean: the same
// backend serves the next request, and none of the transaction's settings
// (lock_timeout, idle_in_transaction_session_timeout) outlive it.
func TestPipelinedClaimFailureLeavesConnectionClean(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	h := e.handler(idem.Endpoint{Wait: 200 * time.Millisecond})
	if r := do(h, "k-clean-1", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	session := func() (pid int32, lockTimeout, idle string) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT pg_backend_pid(), current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout')`).Scan(&pid, &lockTimeout, &idle); err != nil {
			t.Fatal(err)
		}
		return pid, lockTimeout, idle
	}
	pid, lockTimeout, idle := session()

	locker, err := pgx.Connect(ctx, pool.Config().ConnConfig.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close(ctx)
	ltx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ltx.Exec(ctx, `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	r := do(h, "k-clean-2", body1)
	_ = ltx.Rollback(ctx)
	wantProblem(t, r, http.StatusServiceUnavailable)

	if p, l, i := session(); p != pid || l != lockTimeout || i != idle {
		t.Fatalf("after the failed claim: backend %d lock_timeout %q idle %q, want backend %d (reused) and the session's %q %q",
			p, l, i, pid, lockTimeout, idle)
	}
	if r := do(h, "k-clean-2", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("after the lock: %d %s", r.status, r.body)
	}
	if e.calls.Load() != 2 || e.effects() != 2 {
		t.Fatalf("%d calls, %d effects, want 2 and 2", e.calls.Load(), e.effects())
	}
}

// Issue 11: a first request writes its key row once, with the response
// (StoreKey at completion), not a claim row at the start and an update
// with the response at the end: in a new table the row is the page's first
// tuple, where an insert followed by an update leaves it the second.
func TestKeyRowWrittenOnce(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{})
	if r := do(h, "k-once", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	var ctid string
	if err := e.pool.QueryRow(context.Background(), `SELECT ctid::text FROM idem_keys WHERE key = 'k-once'`).Scan(&ctid); err != nil {
		t.Fatal(err)
	}
	if ctid != "(0,1)" {
		t.Fatalf("key row at %s, want (0,1): written more than once", ctid)
	}
	if r := do(h, "k-once", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s", r.status, r.body)
	}
}

// Issue 11: the key's row is written at completion, so a row that appears
// while the function runs (written by something that did not take the key's
// advisory lock: a runtime of an older version, a hand-made repair) must not
// let the effect commit next to it. StoreKey finds it live and fails with a
// serialization failure, the effect rolls back, and the retry replays the
// row that is there: the effect is not doubled.
func TestStoreKeyRefusesARowCompletedElsewhere(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var once sync.Once
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		once.Do(func() {
			pgtest.Exec(t, e.pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
				SELECT 'test.charge', '', 'k-elsewhere', fingerprint, 201, '{"Content-Type":["application/json"]}', '{"elsewhere":true}', now() + interval '1 hour'
				FROM (SELECT '\x00'::bytea AS fingerprint) f`)
		})
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 2 * time.Second})
	r := do(h, "k-elsewhere", body1)
	if e.effects() != 0 {
		t.Fatalf("%d effects committed next to a key completed elsewhere, want 0", e.effects())
	}
	if e.keys() != 1 {
		t.Fatalf("%d key rows, want 1", e.keys())
	}
	var body string
	if err := e.pool.QueryRow(ctx, `SELECT convert_from(body, 'UTF8') FROM idem_keys WHERE key = 'k-elsewhere'`).Scan(&body); err != nil {
		t.Fatal(err)
	}
	if body != `{"elsewhere":true}` {
		t.Fatalf("stored body %s: the row written elsewhere was overwritten", body)
	}
	// The retry found the row; its fingerprint is not this request's, so
	// the answer is the mismatch (422), not a second run.
	if r.status != http.StatusUnprocessableEntity {
		t.Fatalf("answer %d %s, want 422 (the key was used with another body)", r.status, r.body)
	}
	if e.calls.Load() != 1 {
		t.Fatalf("function ran %d times, want 1", e.calls.Load())
	}
}

// Issue 11: a first request whose claim saw no row stores its response
// with a plain INSERT (StoreNewKey), which an expired row written meanwhile
// by something that did not take the key's lock makes fail with a unique
// violation, where StoreKey's ON CONFLICT would take the row over in place.
// Nothing commits next to it: the retry claims the expired row, runs the
// function again and replaces the row, one effect in all. (The second run is
// how this test knows StoreNewKey was sent.)
func TestStoreNewKeyRetriesOverAnExpiredRowWrittenElsewhere(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var once sync.Once
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		once.Do(func() {
			pgtest.Exec(t, e.pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
				VALUES ('test.charge', '', 'k-expired-elsewhere', '\x00'::bytea, 201, '{}', '{"elsewhere":true}', now() - interval '1 second')`)
		})
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 2 * time.Second})
	if r := do(h, "k-expired-elsewhere", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("answer %d replayed=%q %s, want 201 from a run", r.status, r.header.Get("Idempotent-Replayed"), r.body)
	}
	if n := e.effects(); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("function ran %d times, want 2 (the first run's store met the row and rolled back)", n)
	}
	var body string
	var live bool
	if err := e.pool.QueryRow(ctx, `SELECT convert_from(body, 'UTF8'), expires_at > now() FROM idem_keys WHERE key = 'k-expired-elsewhere'`).Scan(&body, &live); err != nil {
		t.Fatal(err)
	}
	if body == `{"elsewhere":true}` || !live {
		t.Fatalf("stored body %s live=%v: the expired row was not replaced", body, live)
	}
	if r := do(h, "k-expired-elsewhere", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("second request: %d replayed=%q, want a replay", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("function ran %d times after the replay, want 2", n)
	}
}

// Issue 11 review: the TTL counts from the completion (StoreKey), not from
// the claim at the transaction's start: a function slower than its TTL
// still leaves a key that is replayed, where it was stored already expired
// and the next request with the key ran the function again.
func TestTTLCountsFromCompletion(t *testing.T) {
	e := newEnv(t)
	// The function outlasts the TTL by half a TTL; the replay must come
	// within the TTL of the completion: 1s leaves a loaded machine room for
	// the COMMIT and the second request's claim (400ms left it less).
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		time.Sleep(1500 * time.Millisecond)
		return nil
	}
	h := e.handler(idem.Endpoint{TTL: time.Second})
	if r := do(h, "k-slow", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	if r := do(h, "k-slow", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("right after a completion slower than the TTL: %d replayed=%q, want a replay", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("function ran %d times, want 1", n)
	}
}

// Issue 11: a first request's claim sends no row lock. LockExpiredKey
// (SELECT … FOR UPDATE) costs the backend CPU even when there is no row to
// lock, and it used to be in every keyed claim; it is sent now only when
// the claim takes over an expired row (TestClaimStatementsLockOnlyATakenOverRow
// checks that row is locked). Observed on the wire: pgx names a cached
// statement after its text's hash, in its Parse and in every Bind, so
// whether LockExpiredKey was sent is whether that name was written.
func TestFirstRequestLocksNoRow(t *testing.T) {
	t.Parallel()
	var wire wireLog
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1; c.ConnConfig.DialFunc = wire.Dial })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	digest := sha256.Sum256([]byte(db.LockExpiredKey))
	lockStmt := []byte("stmtcache_" + hex.EncodeToString(digest[:24])) // as pgx's stmtcache.StatementName
	sent := func(op func()) int {
		wire.reset()
		op()
		c, err := pool.Acquire(context.Background()) // waits for a background ROLLBACK
		if err != nil {
			t.Fatal(err)
		}
		c.Release()
		return bytes.Count(wire.bytes(), lockStmt)
	}
	for _, tc := range []struct {
		name string
		tx   pgx.TxOptions
	}{
		{"read-committed", pgx.TxOptions{}},
		{"repeatable-read", pgx.TxOptions{IsoLevel: pgx.RepeatableRead}},
		{"custom-BeginQuery", pgx.TxOptions{BeginQuery: "begin isolation level repeatable read; set local statement_timeout = '5s'"}},
	} {
		h := e.handlerWith(idem.Endpoint{Scope: "test." + tc.name}, func(c *idem.HTTPConfig) { c.TxOptions = tc.tx })
		key := "k-lock-" + tc.name
		if n := sent(func() {
			if r := do(h, key, body1); r.status != http.StatusCreated {
				t.Fatalf("%s: first: %d %s", tc.name, r.status, r.body)
			}
		}); n != 0 {
			t.Errorf("%s: a first request sent LockExpiredKey %d times, want none", tc.name, n)
		}
		if n := sent(func() { do(h, key, body1) }); n != 0 {
			t.Errorf("%s: a replay sent LockExpiredKey %d times, want none", tc.name, n)
		}
		pgtest.Exec(t, pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE key = '`+key+`'`)
		if n := sent(func() {
			if r := do(h, key, body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("%s: takeover: %d %s", tc.name, r.status, r.body)
			}
		}); n == 0 {
			t.Errorf("%s: the takeover of an expired key did not send LockExpiredKey", tc.name)
		}
	}
	if n := e.calls.Load(); n != 6 {
		t.Fatalf("function ran %d times, want 6", n)
	}
}

// wireLog is a pgconn DialFunc whose connections keep what they write.
type wireLog struct {
	mu  sync.Mutex
	buf []byte
}

func (w *wireLog) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &loggingConn{Conn: c, w: w}, nil
}

func (w *wireLog) reset() { w.mu.Lock(); w.buf = w.buf[:0]; w.mu.Unlock() }

func (w *wireLog) bytes() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return bytes.Clone(w.buf)
}

type loggingConn struct {
	net.Conn
	w *wireLog
}

func (c *loggingConn) Write(p []byte) (int, error) {
	c.w.mu.Lock()
	c.w.buf = append(c.w.buf, p...)
	c.w.mu.Unlock()
	return c.Conn.Write(p)
}
