package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/db"
)

// The tests of this file are an outside review's regression tests (issue 9
// follow-up). They use their own client: net/http with a per-request
// deadline, never the handler in-process.

// callWithin sends a POST with key ("" for none) and answers the status and
// header, or status -1 when no response came within limit (the client's own
// bound, far above any bound the runtime promises).
func callWithin(t *testing.T, limit time.Duration, method, url, key, body string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		return -1, nil, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// A database that stops answering (a network partition: the TCP connection
// stays open, no byte comes back) while a request begins its transaction or
// claims its key: the answer is a 503 with Retry-After shortly after wait,
// not a request hanging until the client gives up, and nothing commits — the
// same key runs once the database is back.
func TestUnansweringDatabaseIs503WithinWait(t *testing.T) {
	t.Parallel()
	base := pgtest.Schema(t)
	proxy := faultproxy.New(t, faultproxy.PostgresTarget(base))
	cfg, err := pgxpool.ParseConfig(proxy.RewriteURL(base))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
		calls.Add(1)
		_, err := tx.Exec(ctx, "SELECT 1")
		return receipt{Order: r.Order}, err
	}
	mux := http.NewServeMux()
	mux.Handle("/keyed", idem.Handle(engine, idem.Endpoint{Scope: "keyed", Wait: 300 * time.Millisecond}, fn))
	mux.Handle("/optional", idem.Handle(engine, idem.Endpoint{Scope: "optional", Wait: 300 * time.Millisecond, KeyOptional: true}, fn))
	url := serveReal(t, mux)
	// Warm the pool, so the requests below reuse a connection made before the
	// partition (the begin goes out on it and is never answered).
	if st, _, b := callWithin(t, 10*time.Second, "POST", url+"/keyed", "warm", body1); st != http.StatusOK {
		t.Fatalf("warm-up: %d %s", st, b)
	}

	for _, c := range []struct{ path, key string }{{"/keyed", "k-partition"}, {"/optional", ""}} {
		proxy.Blackhole()
		st, h, b := callWithin(t, 10*time.Second, "POST", url+c.path, c.key, body1)
		proxy.Restore()
		if st != http.StatusServiceUnavailable || h.Get("Retry-After") == "" || h.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("%s during a partition: status %d (-1: no answer within 10s, wait is 300ms), Retry-After %q: %s",
				c.path, st, h.Get("Retry-After"), b)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the function ran %d times, want 1 (the warm-up only)", n)
	}
	if st, h, b := callWithin(t, 10*time.Second, "POST", url+"/keyed", "k-partition", body1); st != http.StatusOK || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("same key after the partition: %d replayed=%q %s", st, h.Get("Idempotent-Replayed"), b)
	}
}

// An *idem.Error whose status is not a 4xx or 5xx, from the function or from
// Principal, is a programming error answered as a 500 problem: not a 200 or
// a 302 for work that was rolled back (the client would take it for done),
// and not a net/http panic that drops the connection (status 0, 99, 1000).
func TestErrorStatusOutsideFailuresIs500(t *testing.T) {
	e := newEnv(t)
	for _, status := range []int{0, 99, 200, 201, 302, 1000} {
		var calls atomic.Int64
		e.cfg = idem.HTTPConfig{}
		fromFunction := serveReal(t, idem.Handle(e.engine(), idem.Endpoint{Scope: "f"},
			func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
				calls.Add(1)
				if _, err := tx.Exec(ctx, `INSERT INTO effects (order_id, amount) VALUES ('rolled back', 1)`); err != nil {
					return receipt{}, err
				}
				return receipt{}, &idem.Error{Status: status, Detail: "not a failure status"}
			}))
		e.cfg = idem.HTTPConfig{Principal: func(*http.Request) (string, error) {
			return "", &idem.Error{Status: status, Detail: "not a failure status"}
		}}
		fromPrincipal := serveReal(t, idem.Handle(e.engine(), idem.Endpoint{Scope: "p"},
			func(context.Context, pgx.Tx, chargeReq) (receipt, error) { calls.Add(1); return receipt{}, nil }))
		for _, url := range []string{fromFunction, fromPrincipal} {
			st, h, b := callWithin(t, 10*time.Second, "POST", url, "k", body1)
			if st != http.StatusInternalServerError || h.Get("Content-Type") != "application/problem+json" {
				t.Fatalf("*Error{Status: %d}: answered %d (-1: connection dropped) %q %s", status, st, h.Get("Content-Type"), b)
			}
		}
		if calls.Load() != 1 {
			t.Fatalf("*Error{Status: %d}: %d calls, want 1 (the function; Principal's failure stops the other)", status, calls.Load())
		}
	}
	if n := e.effects(); n != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys stored by failures", n, e.keys())
	}
}

// Advisory locks are per database, not per schema. Two services (or tenants,
// or tests) with their own schemas in one database, same scope, same key:
// one's request in flight must not make the other's a 409 (NoWait) or a
// wait. The key's lock id is per idem_keys table.
func TestSameKeyInAnotherSchemaIsNotInFlight(t *testing.T) {
	t.Parallel()
	entered, finish := make(chan struct{}), make(chan struct{})
	serve := func(block bool) string {
		pool := pgtest.Pool(t)
		if err := idem.Migrate(context.Background(), pool); err != nil {
			t.Fatal(err)
		}
		engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return serveReal(t, idem.Handle(engine, idem.Endpoint{Scope: "shared.scope", NoWait: true},
			func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) {
				if block {
					close(entered)
					<-finish
				}
				return receipt{Order: r.Order}, nil
			}))
	}
	first, second := serve(true), serve(false)
	done := make(chan int, 1)
	go func() {
		st, _, _ := callWithin(t, 20*time.Second, "POST", first, "shared-key", body1)
		done <- st
	}()
	<-entered
	st, _, b := callWithin(t, 10*time.Second, "POST", second, "shared-key", body1)
	close(finish)
	if st != http.StatusOK {
		t.Fatalf("same key in another schema's table while the first is in flight: %d %s", st, b)
	}
	if st := <-done; st != http.StatusOK {
		t.Fatalf("first: %d", st)
	}
}

// Duplicates waiting in this process for a key whose first request then
// completes answer its stored response, as a replay, without touching the
// database: never a 409 "still being processed" for a key that completed,
// nor a 503 because replaying needed a connection or a lock. Here the
// idem_keys table is locked (a migration, say) the moment the first request
// commits, so any duplicate that went to the database to replay would wait
// for that lock until its wait ran out.
func TestWaitingDuplicatesReplayTheCompletedResponse(t *testing.T) {
	e := newEnv(t)
	entered, finish := make(chan struct{}), make(chan struct{})
	e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
		if req.Order == "o-1" {
			close(entered)
			<-finish
		}
		return nil
	}
	engine := e.engine()
	ep := idem.Endpoint{Scope: "test.charge", Status: http.StatusCreated, Wait: 2 * time.Second}
	url := serveReal(t, idem.Handle(engine, ep, e.charge))

	type answer struct {
		status int
		header http.Header
		body   string
	}
	first := make(chan answer, 1)
	go func() {
		st, h, b := callWithin(t, 20*time.Second, "POST", url, "storm", body1)
		first <- answer{st, h, b}
	}()
	<-entered
	const dups = 10
	answers := make(chan answer, dups)
	for range dups {
		go func() {
			st, h, b := callWithin(t, 20*time.Second, "POST", url, "storm", body1)
			answers <- answer{st, h, b}
		}()
	}
	// And one with the same key but another body: a client bug, 422.
	other := make(chan answer, 1)
	go func() {
		st, h, b := callWithin(t, 20*time.Second, "POST", url, "storm", `{"order":"o-2","amount":1}`)
		other <- answer{st, h, b}
	}()
	waitFor(t, func() bool { return idem.FlightUsers(engine) == dups+2 })

	// Queue an ACCESS EXCLUSIVE lock behind the first request: it is granted
	// when that request commits, before any duplicate can claim.
	locker, err := e.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(context.Background()) }()
	var lockerPID int
	if err := locker.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&lockerPID); err != nil {
		t.Fatal(err)
	}
	locked := make(chan error, 1)
	go func() {
		_, err := locker.Exec(context.Background(), `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`)
		locked <- err
	}()
	waitFor(t, func() bool {
		return pgtest.Count(t, e.pool, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted`, lockerPID) == 1
	})
	close(finish)
	a := <-first
	if a.status != http.StatusCreated {
		t.Fatalf("first: %d %s", a.status, a.body)
	}
	if err := <-locked; err != nil {
		t.Fatal(err)
	}
	for range dups {
		d := <-answers
		if d.status != http.StatusCreated || d.header.Get("Idempotent-Replayed") != "true" || d.body != a.body ||
			d.header.Get("Location") != a.header.Get("Location") || d.header.Get("Set-Cookie") != "" {
			t.Fatalf("waiting duplicate: %d replayed=%q Location=%q Set-Cookie=%q %s (first: %s)", d.status,
				d.header.Get("Idempotent-Replayed"), d.header.Get("Location"), d.header.Get("Set-Cookie"), d.body, a.body)
		}
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("%d calls", n)
	}
	if o := <-other; o.status != http.StatusUnprocessableEntity {
		t.Fatalf("same key, another body: %d %s", o.status, o.body)
	}
}

// Upgrade path: a database on an older schema (the first release's, which
// had no idem_schema_version) with requests in flight on the keys and the
// processed events. N processes migrate it at once; each must finish (the old
// CREATE INDEX IF NOT EXISTS and CREATE OR REPLACE TRIGGER took locks those
// requests held against them, so Migrate timed out and backed off until its
// context ended, stalling each new request up to a second per attempt), and
// the result is the current schema with every index and the trigger.
func TestMigrateUpgradeUnderLoadFromManyProcesses(t *testing.T) {
	t.Parallel()
	dbURL, pool := oldSchema(t)
	// Requests in flight: a claim and a consumed event, uncommitted, holding
	// ROW EXCLUSIVE on their tables. (Not an outbox insert: this upgrade
	// builds a new index on idem_outbox, idem_outbox_parked, which must wait
	// for the outbox's writers.)
	release := lockTable(t, pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at) VALUES ('s', '', 'in-flight', '', now() + interval '1 hour');
		INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset) VALUES ('c', 'e', 't', 0, 0)`)
	defer release()

	if !migrateInChildren(t, dbURL, 4, 30*time.Second) { // with requests in flight
		t.FailNow()
	}
	if v := pgtest.Count(t, pool, `SELECT count(*) FROM idem_schema_version WHERE digest = $1`, idem.SchemaVersion()); v != 1 {
		t.Fatal("schema version not recorded")
	}
	release()
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname IN
		('idem_keys_expires_at', 'idem_processed_events_processed_at', 'idem_outbox_pending', 'idem_outbox_publishing', 'idem_outbox_published', 'idem_outbox_parked')`); n != 6 {
		t.Fatalf("%d of 6 indexes", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_trigger WHERE tgrelid = 'idem_outbox'::regclass AND tgname = 'idem_outbox_notify'`); n != 1 {
		t.Fatal("no outbox trigger")
	}
}

// A fresh schema gets every index and the trigger from Migrate (the catalog
// checks of schema.sql create what is missing).
func TestMigrateFreshCreatesIndexesAndTrigger(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	for range 2 { // the second run finds everything and creates nothing
		pgtest.Exec(t, pool, idem.Schema())
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname IN
		('idem_keys_expires_at', 'idem_processed_events_processed_at', 'idem_outbox_pending', 'idem_outbox_publishing', 'idem_outbox_published', 'idem_outbox_parked')`); n != 6 {
		t.Fatalf("%d of 6 indexes", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_trigger WHERE tgrelid = 'idem_outbox'::regclass AND tgname = 'idem_outbox_notify'`); n != 1 {
		t.Fatal("no outbox trigger")
	}
}

// On a current schema Migrate reads the version and returns: it does not
// even queue for the migration lock that another process (migrating, or
// stuck) holds. (Since schema.sql's DDL takes no lock requests conflict
// with, TestMigrateCurrentTakesNoLock alone passes without the version
// check; this one does not.)
func TestMigrateCurrentWaitsForNothing(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	// The same lock as templates/query.sql MigrateLock (per schema).
	release := lockTable(t, pool, `SELECT pg_advisory_xact_lock(hashtext('idem_migrate'), hashtext(current_schema()))`)
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate on a current schema while another process holds the migration lock: %v", err)
	}
}

// Allow lists only methods that are served. ServeMux routes HEAD to a GET
// pattern, but an idempotent GET endpoint refuses HEAD (405: it would run
// the function); the 405 of another method must not advertise HEAD then.
// A user's own GET handler does serve HEAD, and Allow says so.
func TestAllowOmitsHeadRefusedByGetEndpoint(t *testing.T) {
	e := newEnv(t)
	engine := e.engine()
	fn := func(ctx context.Context, tx pgx.Tx, r chargeReq) (receipt, error) { return receipt{}, nil }
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /x", idem.Handle(engine, idem.Endpoint{Scope: "p", Route: "POST /x"}, fn))
	idem.HandleRoute(mux, "GET /x", idem.Handle(engine, idem.Endpoint{Scope: "g", Route: "GET /x"}, fn))
	idem.HandleRoute(mux, "POST /y", idem.Handle(engine, idem.Endpoint{Scope: "y", Route: "POST /y"}, fn))
	mux.HandleFunc("GET /y", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "user's") })
	url := serveReal(t, mux)
	st, _, _ := callWithin(t, 10*time.Second, "HEAD", url+"/x", "k", "")
	if st != http.StatusMethodNotAllowed {
		t.Fatalf("HEAD on the idempotent GET: %d, want 405", st)
	}
	for path, want := range map[string]string{"/x": "GET, POST", "/y": "GET, HEAD, POST"} {
		st, h, b := callWithin(t, 10*time.Second, "DELETE", url+path, "k", "")
		if st != http.StatusMethodNotAllowed || h.Get("Allow") != want {
			t.Fatalf("DELETE %s: %d Allow %q, want 405 Allow %q: %s", path, st, h.Get("Allow"), want, b)
		}
	}
	if st, _, _ := callWithin(t, 10*time.Second, "HEAD", url+"/y", "", ""); st != http.StatusOK {
		t.Fatalf("HEAD on the user's GET: %d", st)
	}
}

// A 64-bit collision of the in-flight lock between two keys looks, to the
// second key, like its lock held elsewhere. Standing for one by holding the
// second key's lock id: a completed key still replays its own response, a
// new key waits and is a 409 (never runs, never gets another key's
// response), and runs once the lock is free. So a collision costs a wait,
// never a wrong replay.
func TestLockCollisionOnlyDelays(t *testing.T) {
	e := newEnv(t)
	url := serveReal(t, e.handler(idem.Endpoint{Wait: 300 * time.Millisecond})) + "/charges"
	if st, _, b := callWithin(t, 10*time.Second, "POST", url, "done-key", body1); st != http.StatusCreated {
		t.Fatalf("%d %s", st, b)
	}
	hold := func(key string) func() {
		id := idem.LockID(idem.Key{Scope: "test.charge", Key: key})
		return lockTable(t, e.pool, fmt.Sprintf(`SELECT pg_advisory_xact_lock(%d # 'idem_keys'::regclass::oid::bigint)`, id))
	}
	release := hold("done-key")
	st, h, _ := callWithin(t, 10*time.Second, "POST", url, "done-key", body1)
	release()
	if st != http.StatusCreated || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("completed key under a colliding lock: %d replayed=%q", st, h.Get("Idempotent-Replayed"))
	}
	release = hold("new-key")
	st, _, b := callWithin(t, 10*time.Second, "POST", url, "new-key", body1)
	release()
	if st != http.StatusConflict {
		t.Fatalf("new key under a colliding lock: %d %s", st, b)
	}
	if e.calls.Load() != 1 {
		t.Fatalf("%d calls", e.calls.Load())
	}
	if st, h, b := callWithin(t, 10*time.Second, "POST", url, "new-key", body1); st != http.StatusCreated || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("new key once free: %d %s", st, b)
	}
}

// The migration lock is per schema: a service migrating a fresh schema never
// waits for another schema's migration (here: held open by another session).
func TestMigrateLockIsPerSchema(t *testing.T) {
	t.Parallel()
	other := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	// Migrate's own lock statement, as another replica's migration takes it.
	release := lockTable(t, other, db.MigrateLock)
	defer release()
	fresh := pgtest.Pool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := idem.Migrate(ctx, fresh); err != nil {
		t.Fatalf("Migrate of a fresh schema while another schema's migration holds its lock: %v", err)
	}
}

// oldSchema returns a fresh schema holding the first release's tables
// (testdata/schema-817b008.sql), for the upgrade tests, and a pool on it.
func oldSchema(t *testing.T) (dbURL string, pool *pgxpool.Pool) {
	t.Helper()
	old, err := os.ReadFile("testdata/schema-817b008.sql")
	if err != nil {
		t.Fatal(err)
	}
	dbURL = pgtest.Schema(t)
	pool, err = pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	pgtest.Exec(t, pool, string(old))
	return dbURL, pool
}
