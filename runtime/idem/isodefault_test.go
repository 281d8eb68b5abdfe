package idem_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// With TxOptions{} the transaction's isolation level is the session's
// default_transaction_isolation, which a server, database or role may set
// to repeatable read or serializable. The claim took that level to be read
// committed and left out ClaimKeyRow: a key completed by another
// transaction between this transaction's snapshot (its first statement,
// in the BEGIN round trip) and its claim's lock was invisible to the
// claim, so the function ran a second time for a completed key (its
// StoreNewKey then failed on the row and rolled it back, but whatever the
// function did outside the database was done twice). Now the claim reads
// the level in the same round trip and, under a snapshot, checks the
// unique index before the function runs.
//
// The window is made wide: the completion is committed while the request's
// claim waits for a lock on idem_keys that the completing transaction
// holds, after the request's snapshot was taken.
func TestSessionDefaultIsolationCannotRunACompletedKeyAgain(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			// One connection: the request runs where the first one ran, with
			// its statements prepared (a Parse would wait for the lock
			// before BEGIN, snapshot-less).
			// One connection: the request runs where the first one ran, with
			// its statements prepared (a Parse would wait for the lock
			// before BEGIN, snapshot-less).
			pool, admin := levelPools(t, level, 1)
			ctx := context.Background()
			pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
			e := &env{t: t, pool: pool}
			h := e.handler(idem.Endpoint{Wait: 5 * time.Second})
			if r := do(h, "k1", body1); r.status != http.StatusCreated {
				t.Fatalf("first request: %d %s", r.status, r.body)
			}
			// The key's completed row, as another replica's request
			// completes it: taken out, and put back by a transaction that
			// also locks idem_keys.
			pgtest.Exec(t, admin, `CREATE TABLE saved AS SELECT * FROM idem_keys`)
			pgtest.Exec(t, admin, `DELETE FROM idem_keys`)
			other, err := admin.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer other.Rollback(ctx)
			if _, err := other.Exec(ctx, `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
				t.Fatal(err)
			}
			if _, err := other.Exec(ctx, `INSERT INTO idem_keys SELECT * FROM saved`); err != nil {
				t.Fatal(err)
			}
			done := make(chan result, 1)
			go func() { done <- do(h, "k1", body1) }()
			// The request's claim waits for idem_keys: its snapshot is taken.
			waitLockWait(t, admin, `relation = 'idem_keys'::regclass`, "the request never waited for idem_keys")
			if err := other.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if n := e.calls.Load(); n != 1 {
				t.Fatalf("the function ran %d times for one key (second answer %d %s)", n, r.status, r.body)
			}
			if r.status != http.StatusCreated {
				t.Fatalf("second request: %d %s, want the replay 201", r.status, r.body)
			}
		})
	}
}

// snapshotLevels are the default_transaction_isolation values other than
// read committed that a server, database or role may give every session.
var snapshotLevels = []string{"repeatable read", "serializable"}

// levelPools returns two pools on a fresh schema with idemgen's tables:
// pool's sessions default to the isolation level (at most maxConns
// connections, when not 0), other's to the server's default.
func levelPools(t *testing.T, level string, maxConns int32) (pool, other *pgxpool.Pool) {
	t.Helper()
	url := pgtest.Schema(t)
	pool = pgtest.PoolURL(t, url, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
		if maxConns > 0 {
			c.MaxConns = maxConns
		}
	})
	other = pgtest.PoolURL(t, url, nil)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool, other
}

// rowLockOn is waitLockWait's condition for a wait on a row of table (in
// the pool's schema): another transaction's id, by a session that holds a
// lock on table. pg_locks is the server's: tests elsewhere wait on rows too.
func rowLockOn(table string) string {
	return `locktype = 'transactionid' AND EXISTS (SELECT 1 FROM pg_locks r WHERE r.pid = pg_locks.pid AND r.relation = '` + table + `'::regclass)`
}

// waitLockWait waits until a session waits for a lock pg_locks shows with
// cond (a WHERE condition): the victim's snapshot is then taken and the
// race the test widens is open. what names the waiter for the failure.
func waitLockWait(t *testing.T, pool *pgxpool.Pool, cond, what string) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if pgtest.Count(t, pool, `SELECT count(*) FROM pg_locks WHERE `+cond+` AND NOT granted`) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
	}
}
