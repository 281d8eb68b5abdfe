package idem_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A function that ends the runtime's transaction and chains a new one
// (COMMIT AND CHAIN, ROLLBACK AND CHAIN, or COMMIT then BEGIN) leaves the
// connection in a transaction, so the TxStatus check after the call does
// not see it: the key's advisory lock was released at the end of the first
// transaction, and the response would be stored in another transaction than
// the effect (after ROLLBACK AND CHAIN: a success replayed forever for an
// effect that was rolled back).
func TestFunctionChainingATransactionStoresNothing(t *testing.T) {
	ends := map[string]string{
		"ROLLBACK AND CHAIN": "ROLLBACK AND CHAIN",
		"COMMIT AND CHAIN":   "COMMIT AND CHAIN",
		"ROLLBACK; BEGIN":    "ROLLBACK; BEGIN",
	}
	opts := map[string]pgx.TxOptions{
		"pipelined":               {},
		"custom begin and commit": {BeginQuery: "BEGIN ISOLATION LEVEL READ COMMITTED", CommitQuery: "COMMIT"},
	}
	for name, sql := range ends {
		for oname, o := range opts {
			t.Run(name+"/"+oname, func(t *testing.T) {
				e := newEnv(t)
				e.cfg.TxOptions = o
				e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
					_, err := tx.Exec(ctx, sql)
					return err
				}
				h := e.handler(idem.Endpoint{})
				r := do(h, "k-chain", body1)
				if r.status != http.StatusInternalServerError {
					t.Errorf("answer %d %s, want 500", r.status, r.body)
				}
				// (Under a custom BeginQuery the claim row ClaimKeyRow
				// wrote, already expired, is committed by the function's
				// own COMMIT AND CHAIN: not a response.)
				if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM idem_keys WHERE expires_at > now()`); n != 0 {
					t.Errorf("%d live key rows stored for a function that ended the transaction itself, want 0", n)
				}
				// A retry is not answered by a stored success.
				if r := do(h, "k-chain", body1); r.status != http.StatusInternalServerError {
					t.Errorf("retry: answer %d %s, want 500 again (the function runs again)", r.status, r.body)
				}
			})
		}
	}
}

// A failover or a restart ends every pooled session at once, not just one:
// the retry of the claim batch must not land on another dead idle
// connection and answer 503 (pgxpool pings only connections idle for over
// a second).
func TestClaimRetriedPastEveryDeadIdleConnection(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 4 })
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	e := &env{t: t, pool: pool}
	h := e.handler(idem.Endpoint{})
	killer, err := pgx.Connect(ctx, pool.Config().ConnConfig.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer killer.Close(ctx)
	for i, key := range []string{"k-all-dead-1", "k-all-dead-2"} {
		// Four idle connections in the pool, their sessions all ended.
		var conns []*pgxpool.Conn
		var pids []int32
		for range 4 {
			c, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var pid int32
			if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
			pids = append(pids, pid)
		}
		for _, c := range conns {
			c.Release()
		}
		for _, pid := range pids {
			if _, err := killer.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid); err != nil {
				t.Fatal(err)
			}
		}
		if r := do(h, key, body1); r.status != http.StatusCreated {
			t.Fatalf("request %d after every pooled connection died: %d %s, want 201", i, r.status, r.body)
		}
	}
	if e.calls.Load() != 2 || e.effects() != 2 || e.keys() != 2 {
		t.Fatalf("%d calls, %d effects, %d keys, want 2 each", e.calls.Load(), e.effects(), e.keys())
	}
}

// Every pooled connection cut (a failover) and the database then
// unreachable: the retries past the dead connections end with a 503 when
// the wait runs out, within the wait and its answer slack, not later; the
// same for a request without a key, which begins the same way.
func TestCutThenPartitionIs503WithinWait(t *testing.T) {
	t.Parallel()
	base := pgtest.Schema(t)
	proxy := faultproxy.New(t, faultproxy.PostgresTarget(base))
	cfg, err := pgxpool.ParseConfig(proxy.RewriteURL(base))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := context.Background()
	if err := idem.Migrate(ctx, pool); err != nil {
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
	const wait = 300 * time.Millisecond
	mux := http.NewServeMux()
	mux.Handle("/keyed", idem.Handle(engine, idem.Endpoint{Scope: "keyed", Wait: wait}, fn))
	mux.Handle("/optional", idem.Handle(engine, idem.Endpoint{Scope: "optional", Wait: wait, KeyOptional: true}, fn))
	url := serveReal(t, mux)
	for _, c := range []struct{ path, key string }{{"/keyed", "k-cut"}, {"/optional", ""}} {
		var conns []*pgxpool.Conn
		for range 4 {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			conns = append(conns, conn)
		}
		for _, conn := range conns {
			conn.Release()
		}
		proxy.Cut()
		proxy.Blackhole()
		start := time.Now()
		st, h, b := callWithin(t, 10*time.Second, "POST", url+c.path, c.key, body1)
		took := time.Since(start)
		proxy.Restore()
		t.Logf("%s: %d after %v", c.path, st, took)
		// Not a speed assertion: a retry that began a second wait (or a
		// second answer slack) would take twice wait + 1s.
		if limit := wait + time.Second + time.Second; took > limit {
			t.Errorf("%s: answered after %v, over wait + answer slack + 1s = %v", c.path, took, limit)
		}
		if st != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
			t.Fatalf("%s after a cut and during a partition: status %d (-1: no answer within 10s, wait is %v), Retry-After %q: %s",
				c.path, st, wait, h.Get("Retry-After"), b)
		}
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("the function ran %d times, want 0", n)
	}
}

// A Wait over PostgreSQL's largest lock_timeout (INT_MAX ms, about 24.8
// days) would be refused by the server with every claim, the claim's
// lock_timeout being the time left of the wait: every keyed request a 503,
// forever. Handle refuses it, as NewHTTP refuses such an
// IdleInTransactionTimeout.
func TestWaitOverLockTimeoutMaxRefused(t *testing.T) {
	e := newEnv(t)
	defer func() {
		if recover() == nil {
			r := do(e.handler(idem.Endpoint{Wait: 30 * 24 * time.Hour}), "k-long-wait", body1)
			t.Errorf("Handle accepted a Wait of 30 days; a request then answers %d %s", r.status, r.body)
		}
	}()
	e.handler(idem.Endpoint{Wait: 30 * 24 * time.Hour})
}
