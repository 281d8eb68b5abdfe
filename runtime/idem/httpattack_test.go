package idem_test

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// The tests of this file are an outside attack on the pipelined claim and
// the row written once at completion (branch httpattack): independent
// replicas (one pool and engine each) on one schema, real HTTP over
// loopback.

type stormResp struct {
	ID int64 `json:"id"`
}

// stormReplica is one replica: its own pool, engine and HTTP server. The
// function records the key, its transaction's start (now()) and, through
// the column's default, the time it ran (clock_timestamp()) with the
// effect.
func stormReplica(t *testing.T, dbURL string, cfg idem.HTTPConfig, ep idem.Endpoint, mode pgx.QueryExecMode, calls *atomic.Int64) *httptest.Server {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.DefaultQueryExecMode = mode
	pcfg.ConnConfig.RuntimeParams["application_name"] = stormApp(t)
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	h, err := idem.NewHTTP(idem.NewStore(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /storm", idem.Handle(h, ep, func(ctx context.Context, tx pgx.Tx, req chargeReq) (stormResp, error) {
		calls.Add(1)
		k, _ := idem.KeyFromContext(ctx)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO storm_effects (key, tx_start) VALUES ($1, now()) RETURNING id`, k.Key).Scan(&id); err != nil {
			return stormResp{}, err
		}
		time.Sleep(time.Duration(id%3) * time.Millisecond)
		return stormResp{ID: id}, nil
	}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// stormSchema is a new schema with idem's tables and storm_effects, where
// the functions of stormReplica record their runs; it returns the schema's
// URL and a pool on it for the test's own queries.
func stormSchema(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	dbURL := pgtest.Schema(t)
	admin := pgtest.PoolURL(t, dbURL, nil)
	if err := idem.Migrate(context.Background(), admin); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `CREATE TABLE storm_effects (id bigserial PRIMARY KEY, key text NOT NULL, tx_start timestamptz NOT NULL, ran_at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	return dbURL, admin
}

// stormApp is the application_name of the test's replicas' connections,
// for a killer to find them.
func stormApp(t *testing.T) string { return fmt.Sprintf("storm-%p", t) }

// A storm of duplicates on a few keys, across three replicas, with a TTL so
// short that expired keys are taken over again and again while a janitor
// purges expired rows in a loop. Whatever the isolation level: a key runs
// again only after its previous run's TTL (consecutive effects of one key
// start at least TTL apart), every success a client sees names an effect
// that committed, and no request fails with a 500.
func TestAttackStormAcrossReplicas(t *testing.T) {
	levels := []struct {
		name string
		opts pgx.TxOptions
		mode pgx.QueryExecMode
		kill bool          // terminate a random replica backend every few milliseconds
		ttl  time.Duration // 0: 40ms
		// session: the replicas' default_transaction_isolation ("": the
		// server's), the level of a transaction TxOptions name none for
		session string
	}{
		{"read committed", pgx.TxOptions{}, pgx.QueryExecModeCacheStatement, false, 0, ""},
		{"repeatable read", pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, pgx.QueryExecModeCacheStatement, false, 0, ""},
		{"serializable", pgx.TxOptions{IsoLevel: pgx.Serializable}, pgx.QueryExecModeCacheStatement, false, 0, ""},
		{"custom BeginQuery", pgx.TxOptions{BeginQuery: "BEGIN ISOLATION LEVEL REPEATABLE READ"}, pgx.QueryExecModeCacheStatement, false, 0, ""},
		{"simple protocol", pgx.TxOptions{}, pgx.QueryExecModeSimpleProtocol, false, 0, ""},
		{"exec, repeatable read", pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, pgx.QueryExecModeExec, false, 0, ""},
		{"read committed, backends killed", pgx.TxOptions{}, pgx.QueryExecModeCacheStatement, true, 0, ""},
		{"repeatable read, backends killed", pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, pgx.QueryExecModeCacheStatement, true, 0, ""},
		{"no expiry, backends killed", pgx.TxOptions{}, pgx.QueryExecModeCacheStatement, true, time.Hour, ""},
		{"session default repeatable read", pgx.TxOptions{}, pgx.QueryExecModeCacheStatement, false, 0, "repeatable read"},
		{"session default serializable, backends killed", pgx.TxOptions{}, pgx.QueryExecModeCacheStatement, true, 0, "serializable"},
	}
	for _, lv := range levels {
		t.Run(lv.name, func(t *testing.T) {
			t.Parallel()
			dbURL, admin := stormSchema(t)
			ttl := cmp.Or(lv.ttl, 40*time.Millisecond)
			ep := idem.Endpoint{Scope: "storm", Route: "POST /storm", TTL: ttl, Wait: 3 * time.Second}
			var calls atomic.Int64
			var srvs []*httptest.Server
			for range 3 {
				u := dbURL
				if lv.session != "" {
					u += "&default_transaction_isolation=" + url.PathEscape(lv.session)
				}
				srvs = append(srvs, stormReplica(t, u, idem.HTTPConfig{TxOptions: lv.opts}, ep, lv.mode, &calls))
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var purged atomic.Int64
			janitor, err := idem.NewJanitor(idem.NewStore(admin), idem.JanitorConfig{BatchSize: 2,
				OnRun: func(r idem.JanitorRun) { purged.Add(r.ExpiredKeys) }})
			if err != nil {
				t.Fatal(err)
			}
			wg.Go(func() { // the janitor, run after run
				for ctx.Err() == nil {
					_, _ = janitor.RunOnce(ctx)
					time.Sleep(time.Millisecond)
				}
			})
			if lv.kill {
				wg.Go(func() {
					for ctx.Err() == nil {
						_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
							WHERE application_name = $1 ORDER BY random() LIMIT 1`, stormApp(t))
						time.Sleep(15 * time.Millisecond)
					}
				})
			}
			var mu sync.Mutex
			seen := map[int64]bool{}
			statuses := map[int]int{}
			deadline := time.Now().Add(time.Second)
			for c := range 18 {
				wg.Go(func() {
					for i := 0; time.Now().Before(deadline); i++ {
						srv := srvs[(c+i)%len(srvs)]
						key := fmt.Sprintf("k%d", (c+i)%3)
						req, _ := http.NewRequest(http.MethodPost, srv.URL+"/storm", strings.NewReader(`{"order":"o","amount":1}`))
						req.Header.Set("Idempotency-Key", key)
						resp, err := srv.Client().Do(req)
						if err != nil {
							t.Error(err)
							return
						}
						var out stormResp
						_ = json.NewDecoder(resp.Body).Decode(&out)
						resp.Body.Close()
						mu.Lock()
						statuses[resp.StatusCode]++
						if resp.StatusCode == http.StatusOK {
							seen[out.ID] = true
						}
						mu.Unlock()
					}
				})
			}
			time.Sleep(time.Until(deadline))
			cancel()
			wg.Wait()
			t.Logf("statuses %v, calls %d, expired keys purged %d", statuses, calls.Load(), purged.Load())
			for code, n := range statuses {
				if code != http.StatusOK && code != http.StatusConflict && code != http.StatusServiceUnavailable {
					t.Errorf("%d answers were %d", n, code)
				}
			}
			if statuses[http.StatusOK] == 0 {
				// A storm that reached no function checks nothing below
				// (a replica whose every connection failed answered 503
				// throughout, and passed).
				t.Errorf("no request was answered 200: %v", statuses)
			}
			// The order is checked on ran_at, the time each function ran,
			// not on its transaction's start (now()): a backend delayed
			// (descheduled on a loaded machine) between receiving its
			// BEGIN+claim and running the claim has a transaction start
			// from before the previous row expired and was purged, though
			// it claimed after. A key's row expires TTL after its
			// completion, which is after its function ran, and a claim
			// that runs the key again sees it expired or purged (purged
			// only once expired), so consecutive runs of a key are at
			// least TTL apart in ran_at. CI once saw 26ms between the
			// transaction starts of two runs of a key with a 40ms TTL.
			rows, err := admin.Query(context.Background(), `SELECT id, key, tx_start, ran_at FROM storm_effects ORDER BY key, ran_at`)
			if err != nil {
				t.Fatal(err)
			}
			type eff struct {
				id         int64
				key        string
				start, ran time.Time
			}
			var effs []eff
			committed := map[int64]bool{}
			for rows.Next() {
				var e eff
				if err := rows.Scan(&e.id, &e.key, &e.start, &e.ran); err != nil {
					t.Fatal(err)
				}
				effs = append(effs, e)
				committed[e.id] = true
			}
			if rows.Err() != nil {
				t.Fatal(rows.Err())
			}
			sort.SliceStable(effs, func(i, j int) bool {
				if effs[i].key != effs[j].key {
					return effs[i].key < effs[j].key
				}
				return effs[i].ran.Before(effs[j].ran)
			})
			for i := 1; i < len(effs); i++ {
				a, b := effs[i-1], effs[i]
				if a.key == b.key && b.start.Sub(a.start) < ttl && b.ran.Sub(a.ran) >= ttl {
					t.Logf("key %s: effects %d and %d ran %v apart, their transactions started %v apart (a delayed claim)",
						a.key, a.id, b.id, b.ran.Sub(a.ran), b.start.Sub(a.start))
				}
				if a.key == b.key && b.ran.Sub(a.ran) < ttl {
					t.Errorf("key %s ran twice within its TTL: effects %d ran at %s (transaction from %s) and %d at %s (from %s), %v apart",
						a.key, a.id, a.ran.Format(time.StampMicro), a.start.Format(time.StampMicro),
						b.id, b.ran.Format(time.StampMicro), b.start.Format(time.StampMicro), b.ran.Sub(a.ran))
				}
			}
			for id := range seen {
				if !committed[id] {
					t.Errorf("a client was answered effect %d, which did not commit", id)
				}
			}
			t.Logf("%d effects", len(effs))
		})
	}
}

// A pool may run its statements in any of pgx's query exec modes (a
// PgBouncer in transaction mode wants QueryExecModeExec or
// QueryExecModeSimpleProtocol). In every mode a keyed request runs once,
// stores its response and replays it. Before the fix, the modes that do not
// describe a statement sent the stored headers ([]byte) as a bytea literal,
// which jsonb refused: every keyed request was a 500, after its function had
// run (and rolled back); so was every function that called Enqueue.
func TestKeyedRequestInEveryQueryExecMode(t *testing.T) {
	modes := map[string]pgx.QueryExecMode{
		"cache statement": pgx.QueryExecModeCacheStatement,
		"cache describe":  pgx.QueryExecModeCacheDescribe,
		"describe exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			e := newEnvPool(t, pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode }))
			e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
				return idem.Enqueue(ctx, tx, "charges", req.Order, req)
			}
			h := e.handler(idem.Endpoint{})
			first := do(h, "k-mode", body1)
			if first.status != http.StatusCreated {
				t.Fatalf("first: %d %s", first.status, first.body)
			}
			again := do(h, "k-mode", body1)
			if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" ||
				string(again.body) != string(first.body) || again.header.Get("Location") != first.header.Get("Location") {
				t.Fatalf("replay: %d %v %s, want the first response %s", again.status, again.header, again.body, first.body)
			}
			if n := e.effects(); n != 1 {
				t.Fatalf("%d effects, want 1", n)
			}
			if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM idem_outbox`); n != 1 {
				t.Fatalf("%d outbox events, want 1", n)
			}
			if c := e.calls.Load(); c != 1 {
				t.Fatalf("function ran %d times, want 1", c)
			}
		})
	}
}

// newEnvPool is newEnv on pool.
func newEnvPool(t *testing.T, pool *pgxpool.Pool) *env {
	t.Helper()
	t.Parallel()
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	return &env{t: t, pool: pool}
}

// A function that ends the runtime's transaction itself: its effect is not
// the runtime's to commit any more, so no response may be stored for it (a
// stored response next to a rolled-back effect would be replayed forever
// for an operation that never happened), and the answer is a 500 (the
// function's bug), not a 503 that invites retrying a request that can never
// succeed.
func TestFunctionEndingTheTransactionStoresNothing(t *testing.T) {
	ends := map[string]func(ctx context.Context, tx pgx.Tx) error{
		"pgx Rollback (defer tx.Rollback)": func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
		"SQL ROLLBACK": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "ROLLBACK")
			return err
		},
		"pgx Commit": func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		"SQL COMMIT": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "COMMIT")
			return err
		},
		"a failed statement swallowed": func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, "SELECT 1/0") //idemvet:ignore swallowcancel the mistake this test makes on purpose
			return nil
		},
	}
	for name, end := range ends {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error { return end(ctx, tx) }
			h := e.handler(idem.Endpoint{})
			r := do(h, "k-ends", body1)
			if r.status != http.StatusInternalServerError {
				t.Errorf("answer %d %s, want 500", r.status, r.body)
			}
			if n := e.keys(); n != 0 {
				t.Errorf("%d key rows stored for a function that ended the transaction itself, want 0", n)
			}
		})
	}
}

// oldRuntimeRequest runs one request on key the way the previous runtime
// (30e8498) did: the claim inserts a claim row under the key's advisory
// lock, or takes over an expired row, and the response is an UPDATE at
// completion. It reports whether it ran the effect.
func oldRuntimeRequest(ctx context.Context, pool *pgxpool.Pool, lockID int64, key string, ttl time.Duration) (ran bool, err error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	fp := []byte("fp")
	ct, err := tx.Exec(ctx, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at)
SELECT $1, $2, $3, $4, now() + make_interval(secs => $5::float8)
WHERE CASE WHEN EXISTS (SELECT 1 FROM idem_keys k WHERE k.scope = $1 AND k.principal = $2 AND k.key = $3)
           THEN false
           ELSE pg_try_advisory_xact_lock($6::bigint # 'idem_keys'::regclass::oid::bigint) END
ON CONFLICT (scope, principal, key) DO NOTHING`, "storm", "", key, fp, ttl.Seconds(), lockID)
	if err != nil {
		return false, err
	}
	claimed := ct.RowsAffected() == 1
	if !claimed {
		ct, err = tx.Exec(ctx, `UPDATE idem_keys
SET fingerprint = $4, status_code = 0, headers = '{}', body = '', created_at = now(),
    expires_at = now() + make_interval(secs => $5::float8)
WHERE scope = $1 AND principal = $2 AND key = $3
  AND CASE WHEN expires_at <= now() THEN pg_try_advisory_xact_lock($6::bigint # 'idem_keys'::regclass::oid::bigint) ELSE false END`,
			"storm", "", key, fp, ttl.Seconds(), lockID)
		if err != nil {
			return false, err
		}
		claimed = ct.RowsAffected() == 1
	}
	if !claimed {
		return false, nil // replayed, or in flight: either way no effect
	}
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO storm_effects (key, tx_start) VALUES ($1, now()) RETURNING id`, key).Scan(&id); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, `UPDATE idem_keys SET status_code = 200, headers = '{"Content-Type":["application/json"]}', body = $4
WHERE scope = $1 AND principal = $2 AND key = $3`, "storm", "", key, []byte(fmt.Sprintf(`{"id":%d}`, id))); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

// A rolling upgrade: replicas of the previous runtime (claim row inserted
// at the claim, completed by an UPDATE) and of this one (no row until
// completion) serve the same keys at once. Their claims exclude each other
// through the same advisory lock, so a key still runs at most once per TTL.
func TestAttackMixedVersionReplicas(t *testing.T) {
	for _, ttl := range []time.Duration{time.Hour, 30 * time.Millisecond} {
		t.Run(ttl.String(), func(t *testing.T) {
			t.Parallel()
			dbURL, admin := stormSchema(t)
			ep := idem.Endpoint{Scope: "storm", Route: "POST /storm", TTL: ttl, Wait: 3 * time.Second}
			var calls atomic.Int64
			srvs := []*httptest.Server{
				stormReplica(t, dbURL, idem.HTTPConfig{}, ep, pgx.QueryExecModeCacheStatement, &calls),
				stormReplica(t, dbURL, idem.HTTPConfig{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}}, ep, pgx.QueryExecModeCacheStatement, &calls),
			}
			deadline := time.Now().Add(time.Second)
			var wg sync.WaitGroup
			var oldRan atomic.Int64
			var mu sync.Mutex
			statuses := map[int]int{}
			for c := range 12 {
				wg.Go(func() {
					for i := 0; time.Now().Before(deadline); i++ {
						key := fmt.Sprintf("k%d", (c+i)%2)
						if ttl == time.Hour { // a new key every 20ms: every first claim is a race
							key = fmt.Sprintf("t%d", time.Now().UnixMilli()/20)
						}
						if c%3 == 0 {
							ran, err := oldRuntimeRequest(context.Background(), admin, idem.LockID(idem.Key{Scope: "storm", Key: key}), key, ttl)
							if err != nil && sqlState(err) != "40001" {
								t.Error(err)
								return
							}
							if ran {
								oldRan.Add(1)
							}
							continue
						}
						srv := srvs[(c+i)%len(srvs)]
						req, _ := http.NewRequest(http.MethodPost, srv.URL+"/storm", strings.NewReader(`{"order":"o","amount":1}`))
						req.Header.Set("Idempotency-Key", key) //idemvet:ignore retrykey each iteration is another duplicate of a shared key, not a retry
						resp, err := srv.Client().Do(req)
						if err != nil {
							t.Error(err)
							return
						}
						resp.Body.Close()
						mu.Lock()
						statuses[resp.StatusCode]++
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			t.Logf("new: %v, %d calls; old ran %d", statuses, calls.Load(), oldRan.Load())
			for code, n := range statuses {
				if code != http.StatusOK && code != http.StatusConflict && code != http.StatusServiceUnavailable && code != http.StatusUnprocessableEntity {
					t.Errorf("%d answers were %d", n, code)
				}
			}
			// From the previous run's transaction start (an old version's
			// row expires TTL after it) to the time the next one ran (its
			// claim came before; its own transaction start may predate the
			// previous row's expiry when its backend was delayed, see
			// TestAttackStormAcrossReplicas).
			var bad int64
			if err := admin.QueryRow(context.Background(), `SELECT count(*) FROM (
				SELECT ran_at - lag(tx_start) OVER (PARTITION BY key ORDER BY ran_at) AS gap FROM storm_effects) g
				WHERE gap < make_interval(secs => $1::float8)`, ttl.Seconds()).Scan(&bad); err != nil {
				t.Fatal(err)
			}
			if bad > 0 {
				t.Errorf("%d effects ran within their key's TTL of the previous one", bad)
			}
		})
	}
}

// sqlState is err's SQLSTATE, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// fatalCommitProxy forwards PostgreSQL's protocol between a client and the
// server and, once armed, turns the server's next "COMMIT" CommandComplete
// into a FATAL ErrorResponse (57P01) and closes the connection: what a
// client sees when the server ends the session after the transaction
// committed (a fast shutdown or pg_terminate_backend while a synchronous
// commit waits for its standby: "the transaction has already committed
// locally").
type fatalCommitProxy struct {
	ln     net.Listener
	target string
	armed  atomic.Bool
	fired  atomic.Bool
}

func newFatalCommitProxy(t *testing.T, target string) *fatalCommitProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &fatalCommitProxy{ln: ln, target: target}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *fatalCommitProxy) serve(client net.Conn) {
	defer client.Close()
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer server.Close()
	go func() { _, _ = io.Copy(server, client); server.Close() }()
	r := bufio.NewReader(server)
	for {
		head := make([]byte, 5)
		if _, err := io.ReadFull(r, head); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(head[1:])-4)
		if _, err := io.ReadFull(r, body); err != nil {
			return
		}
		if head[0] == 'C' && string(body) == "COMMIT\x00" && p.armed.CompareAndSwap(true, false) {
			var e []byte
			for _, f := range []string{"SFATAL", "VFATAL", "C57P01", "Mterminating connection due to administrator command"} {
				e = append(append(e, f...), 0)
			}
			e = append(e, 0)
			msg := append([]byte{'E', 0, 0, 0, 0}, e...)
			binary.BigEndian.PutUint32(msg[1:], uint32(len(e)+4))
			_, _ = client.Write(msg)
			p.fired.Store(true)
			return
		}
		if _, err := client.Write(append(head, body...)); err != nil {
			return
		}
	}
}

// The server ends the session right after the COMMIT of the response and
// the effect has committed (the client reads a FATAL error where the
// COMMIT's answer was due). The outcome is unknown to the runtime, so it
// must not answer "nothing was done": a client believing that would give
// up on an operation that happened. The answer is the 503 "Outcome
// unknown", and the retry with the key replays the committed response.
func TestFatalErrorAtCommitAnswersOutcomeUnknown(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	proxy := newFatalCommitProxy(t, faultproxy.PostgresTarget(url))
	direct, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.ConnConfig.Fallbacks = nil
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := &env{t: t, pool: pool}
	h := e.handler(idem.Endpoint{})
	proxy.armed.Store(true)
	first := do(h, "k-fatal-commit", body1)
	if !proxy.fired.Load() {
		t.Fatal("no COMMIT went through the proxy")
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1 (the COMMIT went through)", n)
	}
	if first.status != http.StatusServiceUnavailable || bytes.Contains(first.body, []byte("nothing was done")) ||
		!bytes.Contains(first.body, []byte("unknown")) {
		t.Fatalf("committed, then the session ended: %d %s, want a 503 saying the outcome is unknown", first.status, first.body)
	}
	again := do(h, "k-fatal-commit", body1)
	if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s, want the replay", again.status, again.body)
	}

	// Without a key the same holds, and the answer does not promise a
	// replay it cannot give.
	noKey := e.handler(idem.Endpoint{Scope: "test.nokey", KeyOptional: true})
	proxy.fired.Store(false)
	proxy.armed.Store(true)
	r := do(noKey, "", body1)
	if !proxy.fired.Load() {
		t.Fatal("no COMMIT went through the proxy")
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("%d effects, want 2 (the COMMIT went through)", n)
	}
	if r.status != http.StatusServiceUnavailable || bytes.Contains(r.body, []byte("nothing was done")) ||
		!bytes.Contains(r.body, []byte("unknown")) || bytes.Contains(r.body, []byte("replayed")) {
		t.Fatalf("without a key, committed, then the session ended: %d %s, want a 503 saying the outcome is unknown", r.status, r.body)
	}
}
