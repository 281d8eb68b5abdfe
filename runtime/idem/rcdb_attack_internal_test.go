package idem

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// Outside review (rcattack): readCommittedDB under real faults, in every
// pgx query exec mode (the batch is sent differently in each).
var rcModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

var rcCancelRequest bool

func rcPool(t *testing.T, url, app string, mode pgx.QueryExecMode) *pgxpool.Pool {
	return pgtest.PoolURL(t, url, func(c *pgxpool.Config) {
		c.MaxConns = 1
		if rcCancelRequest {
			c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
				return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, CancelRequestDelay: 0, DeadlineDelay: time.Second}
			}
		}
		c.ConnConfig.DefaultQueryExecMode = mode
		c.ConnConfig.RuntimeParams["application_name"] = app
	})
}

// rcClean fails unless pool's connection is idle outside a transaction and no
// session of app is left in a transaction.
func rcClean(t *testing.T, pool, other *pgxpool.Pool, app string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatalf("acquire after the fault: %v", err)
	}
	if s := c.Conn().PgConn().TxStatus(); s != 'I' {
		t.Errorf("connection back in the pool with TxStatus %q", s)
	}
	c.Release()
	if n := pgtest.Count(t, other, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND (state LIKE 'idle in transaction%' OR xact_start IS NOT NULL AND state <> 'active')`, app); n != 0 {
		t.Errorf("%d session(s) of %s left in a transaction", n, app)
	}
}

// rcEnv is a fresh schema with ddl run in it, and the adapter on a pool of
// one connection in mode, whose sessions are named app; other is a pool of
// the server's defaults on the same schema.
func rcEnv(t *testing.T, mode pgx.QueryExecMode, ddl string) (d readCommittedDB, pool, other *pgxpool.Pool, app string) {
	t.Helper()
	url := pgtest.Schema(t)
	app = rcApp(t)
	pool = rcPool(t, url, app, mode)
	other = pgtest.PoolURL(t, url, nil)
	if ddl != "" {
		pgtest.Exec(t, other, ddl)
	}
	return readCommittedDB{pool}, pool, other, app
}

func rcApp(t *testing.T) string {
	return fmt.Sprintf("rcattack_%d", time.Now().UnixNano())
}

func TestRCDBStatementErrorLeavesNoTransaction(t *testing.T) {
	for _, mode := range rcModes {
		t.Run(mode.String(), func(t *testing.T) {
			d, pool, other, app := rcEnv(t, mode, `CREATE TABLE t (x int); INSERT INTO t SELECT generate_series(1, 5)`)
			ctx := context.Background()
			// rows, then an error
			rows, err := d.Query(ctx, `SELECT 10/(x-3) FROM t ORDER BY x`)
			if err == nil {
				n := 0
				for rows.Next() {
					n++
				}
				rows.Close()
				err = rows.Err()
				t.Logf("rows before the error: %d", n)
			}
			if err == nil || !strings.Contains(err.Error(), "22012") {
				t.Fatalf("query: %v, want division by zero", err)
			}
			rcClean(t, pool, other, app)
			// an UPDATE that takes row locks, then fails
			if _, err := d.Exec(ctx, `UPDATE t SET x = 10/(x-3)`); err == nil {
				t.Fatal("exec: no error")
			}
			rcClean(t, pool, other, app)
			var x int
			if err := d.QueryRow(ctx, `UPDATE t SET x = 10/(x-3) WHERE x = 3 RETURNING x`).Scan(&x); err == nil {
				t.Fatal("query row: no error")
			}
			rcClean(t, pool, other, app)
			pgtest.Exec(t, other, `SET lock_timeout = '2s'; UPDATE t SET x = x`)
			// and it still works
			if tag, err := d.Exec(ctx, `UPDATE t SET x = x + 1 WHERE x = 1`); err != nil || tag.RowsAffected() != 1 {
				t.Fatalf("exec after the faults: %v %v", tag, err)
			}
			rcClean(t, pool, other, app)
		})
	}
}

// The statement returned its rows, then COMMIT failed (a deferred
// constraint): the rows are not the statement's result.
func TestRCDBCommitFailsAfterRows(t *testing.T) {
	for _, mode := range rcModes {
		t.Run(mode.String(), func(t *testing.T) {
			d, pool, other, app := rcEnv(t, mode, `CREATE TABLE p (id int PRIMARY KEY); CREATE TABLE c (pid int REFERENCES p DEFERRABLE INITIALLY DEFERRED)`)
			ctx := context.Background()
			rows, err := d.Query(ctx, `INSERT INTO c VALUES (1), (2) RETURNING pid`)
			if err != nil {
				t.Fatalf("query: %v", err)
			}
			n := 0
			for rows.Next() {
				n++
			}
			if err := rows.Err(); err == nil || !strings.Contains(err.Error(), "23503") {
				t.Fatalf("rows.Err after %d rows: %v, want the COMMIT's 23503", n, err)
			}
			rows.Close()
			rcClean(t, pool, other, app)
			var pid int
			if err := d.QueryRow(ctx, `INSERT INTO c VALUES (1) RETURNING pid`).Scan(&pid); err == nil || !strings.Contains(err.Error(), "23503") {
				t.Fatalf("query row: %v (pid %d), want the COMMIT's 23503", err, pid)
			}
			rcClean(t, pool, other, app)
			if _, err := d.Exec(ctx, `INSERT INTO c VALUES (1)`); err == nil || !strings.Contains(err.Error(), "23503") {
				t.Fatalf("exec: %v, want the COMMIT's 23503", err)
			}
			rcClean(t, pool, other, app)
			// Close without reading every row: the COMMIT is still read.
			rows, err = d.Query(ctx, `INSERT INTO c VALUES (1), (2) RETURNING pid`)
			if err != nil {
				t.Fatal(err)
			}
			rows.Next()
			rows.Close()
			if err := rows.Err(); err == nil {
				t.Fatal("closed early: no error")
			}
			rcClean(t, pool, other, app)
			if n := pgtest.Count(t, other, `SELECT count(*) FROM c`); n != 0 {
				t.Fatalf("%d rows committed", n)
			}
		})
	}
}

// The backend is terminated during COMMIT, after the statement's rows were
// sent.
func TestRCDBTerminatedDuringCommit(t *testing.T) {
	for _, mode := range rcModes {
		t.Run(mode.String(), func(t *testing.T) {
			d, pool, other, app := rcEnv(t, mode, `CREATE TABLE c (x int);
CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON c DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow()`)
			ctx := context.Background()
			go func() {
				for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
					var n int64
					_ = other.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND wait_event = 'PgSleep'`, app).Scan(&n)
					if n > 0 {
						return
					}
				}
			}()
			start := time.Now()
			rows, err := d.Query(ctx, `INSERT INTO c VALUES (1), (2) RETURNING x`)
			n := 0
			if err == nil {
				for rows.Next() {
					n++
				}
				err = rows.Err()
				rows.Close()
			}
			t.Logf("after %v, %d rows: %v", time.Since(start), n, err)
			if err == nil {
				t.Fatal("no error")
			}
			rcClean(t, pool, other, app)
			if n := pgtest.Count(t, other, `SELECT count(*) FROM c`); n != 0 {
				t.Fatalf("%d rows committed", n)
			}
		})
	}
}

// ctx ends while the statement waits on a row lock; the pool must not keep
// a connection in a transaction, and the call must return by the deadline.
func TestRCDBDeadlineWaitingOnALock(t *testing.T) {
	for _, mode := range rcModes {
		t.Run(mode.String(), func(t *testing.T) {
			d, pool, other, app := rcEnv(t, mode, `CREATE TABLE t (x int); INSERT INTO t VALUES (1)`)
			bg := context.Background()
			tx, err := other.Begin(bg)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(bg)
			if _, err := tx.Exec(bg, `UPDATE t SET x = 2`); err != nil {
				t.Fatal(err)
			}
			for i, call := range []func(ctx context.Context) error{
				func(ctx context.Context) error { _, err := d.Exec(ctx, `UPDATE t SET x = x + 10`); return err },
				func(ctx context.Context) error {
					rows, err := d.Query(ctx, `UPDATE t SET x = x + 100 RETURNING x`)
					if err != nil {
						return err
					}
					for rows.Next() {
					}
					rows.Close()
					return rows.Err()
				},
				func(ctx context.Context) error {
					var x int
					return d.QueryRow(ctx, `UPDATE t SET x = x + 1000 RETURNING x`).Scan(&x)
				},
			} {
				ctx, cancel := context.WithTimeout(bg, 300*time.Millisecond)
				start := time.Now()
				err := call(ctx)
				cancel()
				if el := time.Since(start); err == nil || el > 2*time.Second {
					t.Fatalf("call %d: %v after %v", i, err, el)
				}
			}
			if err := tx.Commit(bg); err != nil {
				t.Fatal(err)
			}
			time.Sleep(500 * time.Millisecond)
			var x int64
			x = pgtest.Count(t, other, `SELECT x FROM t`)
			t.Logf("x after the lock's release: %d (statements whose client gave up may still have committed, as autocommit's)", x)
			rcClean(t, pool, other, app)
		})
	}
}

func TestRCDBCancelRequestPool(t *testing.T) {
	rcCancelRequest = true
	defer func() { rcCancelRequest = false }()
	t.Run("deadline", TestRCDBDeadlineWaitingOnALock)
	t.Run("error", TestRCDBStatementErrorLeavesNoTransaction)
	t.Run("commit", TestRCDBCommitFailsAfterRows)
}

// A prepared statement whose result type changed (an ALTER of a returned
// column's type, as an upgrade's migration may do): the first run fails
// (0A000), the next ones must not fail forever.
func TestRCDBResultTypeChanged(t *testing.T) {
	for _, mode := range rcModes {
		t.Run(mode.String(), func(t *testing.T) {
			d, pool, other, app := rcEnv(t, mode, `CREATE TABLE t (x int); INSERT INTO t VALUES (1)`)
			ctx := context.Background()
			q := func() error {
				rows, err := d.Query(ctx, `UPDATE t SET x = x RETURNING x`)
				if err != nil {
					return err
				}
				for rows.Next() {
					var x int64
					if err := rows.Scan(&x); err != nil {
						rows.Close()
						return err
					}
				}
				rows.Close()
				return rows.Err()
			}
			ex := func() error { _, err := d.Exec(ctx, `UPDATE t SET x = x`); return err }
			if err := q(); err != nil {
				t.Fatal(err)
			}
			if err := ex(); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, other, `ALTER TABLE t ALTER COLUMN x TYPE bigint`)
			var errs []error
			for i := 0; i < 3; i++ {
				errs = append(errs, q())
			}
			t.Logf("after the ALTER: %v", errs)
			if errs[2] != nil {
				t.Fatalf("still failing: %v", errs)
			}
			rcClean(t, pool, other, app)
		})
	}
}

// The pool is exhausted: each call fails by its deadline and leaves nothing
// behind.
func TestRCDBPoolExhausted(t *testing.T) {
	d, pool, other, app := rcEnv(t, pgx.QueryExecModeCacheStatement, "")
	held, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_, err1 := d.Exec(ctx, `SELECT 1`)
	_, err2 := d.Query(ctx, `SELECT 1`)
	var x int
	err3 := d.QueryRow(ctx, `SELECT 1`).Scan(&x)
	cancel()
	if err1 == nil || err2 == nil || err3 == nil {
		t.Fatalf("with the pool exhausted: %v, %v, %v", err1, err2, err3)
	}
	held.Release()
	if err := d.QueryRow(context.Background(), `SELECT 1`).Scan(&x); err != nil || x != 1 {
		t.Fatalf("after: %v %d", err, x)
	}
	if s := pool.Stat(); s.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired", s.AcquiredConns())
	}
	rcClean(t, pool, other, app)
}
