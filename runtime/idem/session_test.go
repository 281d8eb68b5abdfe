package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// The session state a function or handler leaves on its pooled connection
// (a session-level SET, set_config(..., false), a temporary table) must not
// outlive its transaction where the runtime's own statements would see it:
// the next request or record on that connection, or this one's own
// StoreKey.

// oneConnEnv is newEnv on a pool of one connection: the next request runs on
// the connection the previous one's function had.
func oneConnEnv(t *testing.T) *env {
	t.Helper()
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	return &env{t: t, pool: pool}
}

// otherSchema is a second schema with idemgen's tables and an effects
// table (another tenant's, another service's); it returns its name.
func otherSchema(t *testing.T) string {
	t.Helper()
	p := pgtest.PoolURL(t, pgtest.Schema(t), nil)
	if err := idem.Migrate(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, p, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL, event_id text, amount2 bigint)`)
	var name string
	if err := p.QueryRow(context.Background(), "SELECT current_schema()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// sessionSettings reads the settings the runtime puts back, on the pool's
// (one) connection.
func sessionSettings(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT concat_ws(' | ', current_setting('search_path'),
		current_setting('default_transaction_read_only'), current_setting('default_transaction_isolation'),
		current_setting('statement_timeout'), current_setting('synchronous_commit'))`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// A function that points search_path at another schema holding idemgen's
// tables (session-level or SET LOCAL) made StoreKey store the key there:
// the request answered 201, and its retry on another connection (or, for
// SET LOCAL, on the same one) found no key in this schema and charged
// again. Now StoreKey refuses (500, nothing committed, the rollback undoes
// the SET) and the retry runs once.
func TestFunctionSearchPathCannotMoveKeys(t *testing.T) {
	for _, c := range []struct{ name, sql string }{
		{"SET", "SET search_path = %s"},
		{"SET LOCAL", "SET LOCAL search_path = %s"},
		{"set_config", "SELECT set_config('search_path', '%s', false)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := oneConnEnv(t)
			other := otherSchema(t)
			fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, strings.ReplaceAll(c.sql, "%s", other))
				return err
			})
			logs := e.captureLogs()
			h := e.handler(idem.Endpoint{})
			r := do(h, "k1", body1)
			if n := pgtest.Count(t, e.pool, "SELECT count(*) FROM "+other+".idem_keys"); n != 0 {
				t.Fatalf("first request: %d %s; the key was stored in schema %s (%d rows there)", r.status, r.body, other, n)
			}
			wantProblem(t, r, http.StatusInternalServerError)
			if !strings.Contains(logs.String(), "changed search_path") {
				t.Fatalf("log does not say what the function did: %s", logs.String())
			}
			e.pool.Reset() // the retry on another connection
			wantRetryRunsAgain(t, e, h, "k1", fix)
		})
	}
}

// A temporary table named idem_keys (the temporary schema comes first in
// every search_path) took the key of this request and of every later one
// on the connection: retries elsewhere charged again. Now it is refused.
func TestFunctionTempTableCannotHideKeys(t *testing.T) {
	e := oneConnEnv(t)
	fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "CREATE TEMP TABLE idem_keys (LIKE idem_keys INCLUDING ALL)")
		return err
	})
	h := e.handler(idem.Endpoint{})
	r := do(h, "k1", body1)
	if n := pgtest.Count(t, e.pool, "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema() AND relname = 'idem_keys'"); n != 0 {
		t.Fatalf("first request: %d %s; a temporary idem_keys stays on the pooled connection", r.status, r.body)
	}
	wantProblem(t, r, http.StatusInternalServerError)
	wantRetryRunsAgain(t, e, h, "k1", fix)
}

// Session-level settings the function made (read-only default, a lowered
// synchronous_commit, a statement_timeout, an isolation default, a
// search_path that still finds the runtime's tables) stayed on the pooled
// connection for every later request: with default_transaction_read_only
// each one failed (500) until the connection was closed, and later
// commits were not durable. Now the runtime puts them back before its
// COMMIT, with a key and without.
func TestFunctionSessionSettingsDoNotOutliveItsTransaction(t *testing.T) {
	for _, keyed := range []bool{true, false} {
		name := "keyless"
		if keyed {
			name = "keyed"
		}
		t.Run(name, func(t *testing.T) {
			e := oneConnEnv(t)
			before := sessionSettings(t, e.pool)
			schema := strings.TrimSpace(strings.Split(before, "|")[0])
			var polluted atomic.Bool
			polluted.Store(true)
			e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
				if !polluted.Swap(false) {
					return nil
				}
				for _, s := range []string{
					"SET search_path = " + schema + ", public",
					"SET default_transaction_read_only = on",
					"SET synchronous_commit = off",
					"SET LOCAL statement_timeout = '1h'", // restored too (it was LOCAL: no harm)
					"SELECT set_config('statement_timeout', '2h', false)",
					"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
				} {
					if _, err := tx.Exec(ctx, s); err != nil {
						return err
					}
				}
				return nil
			}
			h := e.handler(idem.Endpoint{KeyOptional: true})
			key := ""
			if keyed {
				key = "k1"
			}
			if r := do(h, key, body1); r.status != http.StatusCreated {
				t.Fatalf("first: %d %s", r.status, r.body)
			}
			if after := sessionSettings(t, e.pool); after != before {
				t.Fatalf("the connection's settings after the request: %q, before: %q", after, before)
			}
			if keyed {
				key = "k2"
			}
			if r := do(h, key, body1); r.status != http.StatusCreated {
				t.Fatalf("next request on the connection: %d %s", r.status, r.body)
			}
			if e.effects() != 2 {
				t.Fatalf("%d effects, want 2", e.effects())
			}
		})
	}
}

// A temporary table a keyless function makes with a runtime table's name
// would outlive it and hide that table from the next keyed request on the
// connection: refused too.
func TestKeylessFunctionTempTableRefused(t *testing.T) {
	e := oneConnEnv(t)
	fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "CREATE TEMP TABLE idem_keys (LIKE idem_keys INCLUDING ALL)")
		return err
	})
	h := e.handler(idem.Endpoint{KeyOptional: true})
	r := do(h, "", body1)
	if n := pgtest.Count(t, e.pool, "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema() AND relname = 'idem_keys'"); n != 0 {
		t.Fatalf("keyless request: %d %s; a temporary idem_keys stays on the pooled connection", r.status, r.body)
	}
	wantProblem(t, r, http.StatusInternalServerError)
	fix()
	if r := do(h, "k1", body1); r.status != http.StatusCreated {
		t.Fatalf("keyed request after: %d %s", r.status, r.body)
	}
	if e.keys() != 1 {
		t.Fatalf("%d keys in idem_keys, want 1", e.keys())
	}
}

// A function that leaves a SET ROLE in force to a role without rights on
// idem_keys' schema: StoreKey, run as that role, is refused (42501; 42P01
// when the connection prepares it then, the schema being invisible). That
// was answered 503 "storage unavailable; retry later", though no retry
// could succeed while the function does it: now it is the function's
// failure, 500, with nothing stored or committed, and the retry, once the
// function is fixed, runs it again.
func TestFunctionSetRoleAtStoreKeyIsNotAnOutage(t *testing.T) {
	for _, c := range []struct {
		name                  string
		prepared, schemaUsage bool
	}{
		{"schema invisible, first statement on the connection", false, false}, // 42P01 at prepare
		{"schema invisible, statements prepared", true, false},                // 42P01
		{"table not writable", true, true},                                    // 42501
	} {
		t.Run(c.name, func(t *testing.T) {
			e := oneConnEnv(t)
			role := fmt.Sprintf("norights_%d", time.Now().UnixNano())
			pgtest.Exec(t, e.pool, "CREATE ROLE "+role)
			pgtest.Exec(t, e.pool, "GRANT "+role+" TO current_user")
			if c.schemaUsage {
				pgtest.Exec(t, e.pool, "DO $$ BEGIN EXECUTE format('GRANT USAGE ON SCHEMA %I TO "+role+"', current_schema()); END $$")
			}
			t.Cleanup(func() {
				conn, err := pgx.Connect(context.Background(), pgtest.BaseURL())
				if err == nil {
					_, _ = conn.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE IF EXISTS "+role)
					_ = conn.Close(context.Background())
				}
			})
			logs := e.captureLogs()
			h := e.handler(idem.Endpoint{})
			if c.prepared { // the runtime's statements prepared on the connection
				if r := do(h, "k0", body1); r.status != http.StatusCreated {
					t.Fatalf("first request: %d %s", r.status, r.body)
				}
				pgtest.Exec(t, e.pool, "DELETE FROM effects; DELETE FROM idem_keys")
				e.calls.Store(0)
			}
			fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SET ROLE "+role)
				return err
			})
			r := do(h, "k1", body1)
			if r.status != http.StatusInternalServerError {
				t.Fatalf("status %d, want 500; log: %s", r.status, logs.String())
			}
			if c.schemaUsage && !strings.Contains(logs.String(), "SQLSTATE 42501") {
				t.Fatalf("not refused permission on idem_keys: %s", logs.String())
			}
			wantRetryRunsAgain(t, e, h, "k1", fix)
		})
	}
}
