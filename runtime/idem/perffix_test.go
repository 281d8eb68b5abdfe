package idem_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Issue 11 review: many clients, through a real HTTP client, against two
// replicas (two engines, two pools) on one key whose TTL (50ms) is shorter
// than the function: every request lands at or past the key's expiry, so
// every one of them tries the conditional takeover. Within one generation
// the function never runs twice (no two runs ever overlap), every executed
// answer is a distinct committed effect, and every replay is byte for byte
// one of the executed answers.
func TestTinyTTLStormOneRunPerGeneration(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{"", pgx.RepeatableRead, pgx.Serializable} {
		t.Run("iso="+string(iso), func(t *testing.T) { storm(t, iso, 50*time.Millisecond) })
	}
}

// Issue 11 review: the same storm on a key with a long TTL (a replay racing
// with the first request's COMMIT, from both replicas and with a second,
// different request on the key): one run, every 201 the same body, the
// other request 422.
func TestNewKeyStormOneRun(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{"", pgx.RepeatableRead, pgx.Serializable} {
		t.Run("iso="+string(iso), func(t *testing.T) { storm(t, iso, time.Hour) })
	}
}

const bodyOther = `{"order":"o-other","amount":5}`

func storm(t *testing.T, iso pgx.TxIsoLevel, ttl time.Duration) {
	e := newEnv(t)
	e.cfg.TxOptions = pgx.TxOptions{IsoLevel: iso}
	var running, overlap atomic.Int32
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if running.Add(1) > 1 {
			overlap.Add(1)
		}
		defer running.Add(-1)
		time.Sleep(20 * time.Millisecond)
		return nil
	}
	ep := idem.Endpoint{TTL: ttl, Wait: 5 * time.Second}
	pool2, err := pgxpool.NewWithConfig(context.Background(), e.pool.Config().Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer pool2.Close()
	e2 := &env{t: t, pool: pool2, hook: e.hook, cfg: e.cfg}
	srv1 := httptest.NewServer(e.handler(ep))
	defer srv1.Close()
	srv2 := httptest.NewServer(e2.handler(ep))
	defer srv2.Close()

	var mu sync.Mutex
	executed := map[string]string{} // answer -> request body
	type replay struct{ req, answer string }
	var replayed []replay
	statuses := map[int]int{}
	deadline := time.Now().Add(1500 * time.Millisecond)
	var wg sync.WaitGroup
	for g := range 12 {
		wg.Go(func() {
			url, body := srv1.URL, body1
			if g%2 == 1 {
				url = srv2.URL
			}
			if g%4 == 3 {
				body = bodyOther
			}
			for time.Now().Before(deadline) {
				req, _ := http.NewRequest(http.MethodPost, url+"/charges", strings.NewReader(body))
				req.Header.Set("Idempotency-Key", "k-storm")
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				mu.Lock()
				statuses[resp.StatusCode]++
				if resp.StatusCode == http.StatusCreated {
					if resp.Header.Get("Idempotent-Replayed") == "true" {
						replayed = append(replayed, replay{body, string(b)})
					} else {
						if _, dup := executed[string(b)]; dup {
							t.Errorf("two executions answered the same body %s", b)
						}
						executed[string(b)] = body
					}
				} else if resp.StatusCode != http.StatusUnprocessableEntity && resp.StatusCode != http.StatusConflict {
					t.Errorf("answered %d %s", resp.StatusCode, b)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	calls := e.calls.Load() + e2.calls.Load()
	t.Logf("statuses %v, executed %d, replayed %d, calls %d", statuses, len(executed), len(replayed), calls)
	if n := overlap.Load(); n != 0 {
		t.Fatalf("the function ran %d times while another run of the same key was in progress", n)
	}
	for _, r := range replayed {
		if req, ok := executed[r.answer]; !ok || req != r.req {
			t.Errorf("a replay of %s answered %s, which no execution of that request answered", r.req, r.answer)
		}
	}
	if eff := e.effects(); calls != eff || eff != int64(len(executed)) {
		t.Fatalf("%d calls, %d effects, %d executed answers: want all equal", calls, eff, len(executed))
	}
	if ttl >= time.Minute && len(executed) != 1 {
		t.Fatalf("a live key ran %d times", len(executed))
	}
}

// slowCommit makes the COMMIT of a request with amount 7 take a second: a
// deferred constraint trigger sleeps at COMMIT, i.e. inside the pipelined
// StoreKey+COMMIT round trip.
func slowCommit(t *testing.T, e *env) {
	pgtest.Exec(t, e.pool, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW WHEN (NEW.amount = 7) EXECUTE FUNCTION slow_commit()`)
}

const bodySlow = `{"order":"o-slow","amount":7}`

// keyState is whether the key's response is committed: the effect and the
// completed key row go together or not at all.
func keyState(t *testing.T, e *env) (committed bool) {
	t.Helper()
	eff := e.effects()
	done := pgtest.Count(t, e.pool, `SELECT count(*) FROM idem_keys WHERE status_code <> 0`)
	all := e.keys()
	if eff != done || all != done {
		t.Fatalf("half state: %d effects, %d completed keys, %d keys", eff, done, all)
	}
	return done == 1
}

// Issue 11 review: the client hangs up while the pipelined StoreKey+COMMIT
// is at the server. The outcome is one of two, and the answer (seen by a
// shutdown-cancelled caller the same way) says which: committed (then the
// answer is the success, and a retry replays it) or not (then a failure, and
// a retry runs the function once). With the connection check off the server
// finishes a COMMIT whose client connection pgx closed on cancellation.
func TestCancelDuringPipelinedCommitIsHonest(t *testing.T) {
	for _, noCheck := range []bool{false, true} {
		t.Run(map[bool]string{false: "conncheck", true: "noconncheck"}[noCheck], func(t *testing.T) {
			e := newEnv(t)
			e.cfg.NoConnCheck = noCheck
			slowCommit(t, e)
			ctx, cancel := context.WithCancel(context.Background())
			e.hook = func(context.Context, pgx.Tx, chargeReq) error {
				time.AfterFunc(300*time.Millisecond, cancel) // during the 1s COMMIT
				return nil
			}
			h := e.handler(idem.Endpoint{Wait: 5 * time.Second})
			first := doCtx(ctx, h, "k-cancel-commit", bodySlow)
			time.Sleep(1500 * time.Millisecond) // let the server finish either way
			committed := keyState(t, e)
			t.Logf("first: %d %s; committed %v", first.status, first.body, committed)
			if committed && bytes.Contains(first.body, []byte("nothing was done")) {
				t.Fatalf("the COMMIT went through but the answer says %s", first.body)
			}
			if !committed && first.status < 500 {
				t.Fatalf("nothing committed but the answer is %d %s", first.status, first.body)
			}
			e.hook = nil
			r := do(h, "k-cancel-commit", bodySlow)
			if r.status != http.StatusCreated {
				t.Fatalf("retry: %d %s", r.status, r.body)
			}
			if !keyState(t, e) || e.effects() != 1 {
				t.Fatalf("after the retry: %d effects", e.effects())
			}
		})
	}
}

// Issue 11 review: the backend is terminated while the pipelined COMMIT is
// at the server. Nothing is stored, the client gets a 5xx that does not
// claim success, and the retry runs the function once.
func TestTerminatedDuringPipelinedCommit(t *testing.T) {
	e := newEnv(t)
	slowCommit(t, e)
	var pid atomic.Uint32
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		pid.Store(tx.Conn().PgConn().PID())
		time.AfterFunc(300*time.Millisecond, func() {
			_, _ = e.pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid.Load())
		})
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 5 * time.Second})
	first := do(h, "k-term-commit", bodySlow)
	if first.status < 500 {
		t.Fatalf("terminated during COMMIT: %d %s, want a 5xx", first.status, first.body)
	}
	if keyState(t, e) {
		t.Fatal("a terminated COMMIT committed")
	}
	e.hook = nil
	if r := do(h, "k-term-commit", bodySlow); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s", r.status, r.body)
	}
	if e.calls.Load() != 2 || e.effects() != 1 {
		t.Fatalf("%d calls, %d effects, want 2, 1", e.calls.Load(), e.effects())
	}
}

// Issue 11 review: idem_uuid_v7 from 8 connections at once, 100k ids: all
// distinct, version 7 / variant 10, and the time prefix that of the clock
// when the id was made.
func TestUUIDv7ConcurrentUnique(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE ids (u uuid NOT NULL, at timestamptz NOT NULL)`)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 5 {
				if _, err := pool.Exec(context.Background(), `INSERT INTO ids SELECT idem_uuid_v7(), clock_timestamp() FROM generate_series(1, 2500)`); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if n := pgtest.Count(t, pool, `SELECT count(DISTINCT u) FROM ids`); n != 100000 {
		t.Fatalf("%d distinct ids of 100000", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM ids WHERE substr(u::text, 15, 1) <> '7' OR substr(u::text, 20, 1) NOT IN ('8','9','a','b')`); n != 0 {
		t.Fatalf("%d ids without version 7 / variant 10", n)
	}
	// The time prefix against the clock read right after it (a loaded
	// machine may preempt the backend between the two by a few ms): never
	// later, never a second earlier.
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM (SELECT floor(extract(epoch FROM at) * 1000)::bigint
		- ('x' || lpad(replace(substr(u::text, 1, 13), '-', ''), 16, '0'))::bit(64)::bigint AS d FROM ids) x
		WHERE d < 0 OR d > 1000`); n != 0 {
		t.Fatalf("%d ids whose time prefix is off the clock", n)
	}
}

// Issue 11 review: the network goes down (the connection is reset, and a
// cancel request cannot get through) while the pipelined
// StoreKey+COMMIT is at the server, and the server (without the
// connection check, as on a platform that has none) finishes the COMMIT.
// The client cannot know which way it went, so the answer must not say
// "nothing was done": it is a 503 that says the outcome is unknown, and the
// retry replays the committed response without running the function again.
func TestNetworkDownDuringPipelinedCommitAnswersOutcomeUnknown(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	proxy := faultproxy.New(t, faultproxy.PostgresTarget(url))
	direct, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	pool, err := pgxpool.New(context.Background(), proxy.RewriteURL(url))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool, cfg: idem.HTTPConfig{NoConnCheck: true}}
	check := &env{t: t, pool: direct}
	slowCommit(t, check)
	e.hook = func(_ context.Context, tx pgx.Tx, _ chargeReq) error {
		pid := tx.Conn().PgConn().PID()
		go func() {
			// Once the backend runs the COMMIT (sleeping in the deferred
			// trigger), the network goes down; a cancel request cannot get
			// through either.
			for range 500 {
				var running bool
				_ = direct.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query = 'commit')`, pid).Scan(&running)
				if running {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			proxy.Down()
		}()
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 5 * time.Second})
	first := do(h, "k-cut-commit", bodySlow)
	// The server finishes the COMMIT (its trigger sleeps 1s) after the
	// answer: wait for the completed key, bounded. (A fixed 1.5s sleep bet
	// on the backend's schedule on a loaded machine.)
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if pgtest.Count(t, direct, `SELECT count(*) FROM idem_keys WHERE status_code <> 0`) != 0 {
			break
		}
	}
	if !keyState(t, check) {
		t.Fatal("the COMMIT did not go through: the network did not fail during it")
	}
	if first.status != http.StatusServiceUnavailable || bytes.Contains(first.body, []byte("nothing was done")) ||
		!bytes.Contains(first.body, []byte("unknown")) {
		t.Fatalf("committed, connection cut before the answer: %d %s, want a 503 saying the outcome is unknown", first.status, first.body)
	}
	proxy.Restore()
	e.hook = nil
	r := do(h, "k-cut-commit", bodySlow)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s, want the replay", r.status, r.body)
	}
	if e.calls.Load() != 1 || check.effects() != 1 {
		t.Fatalf("%d calls, %d effects, want 1, 1", e.calls.Load(), check.effects())
	}
}

// Issue 11 review: an outbox whose event_id default is still the random
// gen_random_uuid (the first release's schema) is upgraded by 4 processes
// migrating at once while 4 writers keep inserting outbox rows in short
// transactions. Every process finishes, no insert fails, the default is
// now idem_uuid_v7, and every event id written around the upgrade is
// distinct.
func TestMigrateEventIDDefaultUnderOutboxLoad(t *testing.T) {
	t.Parallel()
	dbURL, pool := oldSchema(t)

	stopWriters := outboxWriters(t, pool, 4)
	time.Sleep(100 * time.Millisecond)
	migrateInChildren(t, dbURL, 4, 60*time.Second)
	// Let the writers insert after the upgrade (they must get a UUIDv7),
	// waiting for such a row rather than a fixed 100ms, which four starved
	// writers can spend without a commit.
	for deadline := time.Now().Add(20 * time.Second); !t.Failed() && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE substr(event_id, 15, 1) = '7'`) != 0 {
			break
		}
	}
	inserted := stopWriters()
	if t.Failed() {
		return
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		WHERE d.adrelid = 'idem_outbox'::regclass AND a.attname = 'event_id' AND pg_get_expr(d.adbin, d.adrelid) = '(idem_uuid_v7())::text'`); n != 1 {
		t.Fatal("event_id default not switched to idem_uuid_v7")
	}
	rows := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox`)
	if distinct := pgtest.Count(t, pool, `SELECT count(DISTINCT event_id) FROM idem_outbox`); distinct != rows || rows != inserted {
		t.Fatalf("%d rows, %d distinct event ids, %d inserts", rows, distinct, inserted)
	}
	if v7 := pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE substr(event_id, 15, 1) = '7'`); v7 == 0 {
		t.Fatal("no insert after the upgrade got a UUIDv7")
	}
	t.Logf("%d inserts, %d with UUIDv7", rows, pgtest.Count(t, pool, `SELECT count(*) FROM idem_outbox WHERE substr(event_id, 15, 1) = '7'`))
}

// Issue 11 review: replays while the pool is exhausted. With one pooled
// connection held by another transaction, a replay waits for it at most
// Wait and answers 503 (never a half answer, never a run); once it is
// free, 40 concurrent replays of 20 keys (each replay ends its empty
// transaction after answering, in the background, before its connection
// returns to the pool) all get their stored responses, with no run.
func TestReplayWhilePoolExhausted(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	h := e.handler(idem.Endpoint{Wait: 10 * time.Second})
	want := map[string]string{}
	for i := range 20 {
		k := "k-pool-" + string(rune('a'+i))
		r := do(h, k, body1)
		if r.status != http.StatusCreated {
			t.Fatalf("first %s: %d %s", k, r.status, r.body)
		}
		want[k] = string(r.body)
	}
	hold, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	short := e.handler(idem.Endpoint{Wait: 200 * time.Millisecond})
	if r := do(short, "k-pool-a", body1); r.status != http.StatusServiceUnavailable {
		t.Fatalf("replay with no connection free: %d %s, want 503", r.status, r.body)
	}
	hold.Release()
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			k := "k-pool-" + string(rune('a'+i%20))
			r := do(h, k, body1)
			if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" || string(r.body) != want[k] {
				t.Errorf("replay %s: %d %s, want the stored %s", k, r.status, r.body, want[k])
			}
		})
	}
	wg.Wait()
	if e.calls.Load() != 20 || e.effects() != 20 {
		t.Fatalf("%d calls, %d effects, want 20", e.calls.Load(), e.effects())
	}
}
