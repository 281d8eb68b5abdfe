package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/dbx"
)

// Issue 11: the claim locks no row on the common path (a FOR UPDATE costs
// the backend CPU even with no row to lock); only a claim that takes over an
// expired row locks it, in one more round trip before the function runs.
// On every way a claim is begun (pipelined under read committed, pipelined
// under repeatable read, a custom BeginQuery): the expired row of a key this
// transaction claims is locked before the claim returns, under the claim's
// lock_timeout (a purge holding it makes the claim fail with
// lock_not_available, not wait for the session's unbounded one); the
// session's lock_timeout is back after the claim, with or without a row; a
// live row (a replay) is not locked, and neither is the expired row of a key
// whose advisory lock another transaction holds.
func TestClaimStatementsLockOnlyATakenOverRow(t *testing.T) {
	t.Parallel()
	pool := migrated(t)
	ctx := context.Background()
	pgtest.Exec(t, pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, expires_at) VALUES
		('s', '', 'live', '\x01', 201, now() + interval '1 day')`)
	var session string
	if err := pool.QueryRow(ctx, `SHOW lock_timeout`).Scan(&session); err != nil {
		t.Fatal(err)
	}
	const claimTimeout = 200 * time.Millisecond
	type claimFunc func(ctx context.Context, conn *pgx.Conn, arg db.ClaimKeyParams) (pgx.Tx, bool, bool, db.GetKeyRow, error)
	pipelined := func(opts pgx.TxOptions) claimFunc {
		return func(ctx context.Context, conn *pgx.Conn, arg db.ClaimKeyParams) (pgx.Tx, bool, bool, db.GetKeyRow, error) {
			tx, claimed, found, _, row, err := dbx.BeginClaim(ctx, conn, opts, dbx.Settings{LockTimeout: claimTimeout}, arg)
			return tx, claimed, found, row, err
		}
	}
	custom := func(ctx context.Context, conn *pgx.Conn, arg db.ClaimKeyParams) (pgx.Tx, bool, bool, db.GetKeyRow, error) {
		opts := pgx.TxOptions{BeginQuery: "begin isolation level repeatable read"}
		start := time.Now()
		tx, err := conn.BeginTx(ctx, dbx.BoundedBegin(opts, claimTimeout, 0, 0))
		if err != nil {
			return nil, false, false, db.GetKeyRow{}, err
		}
		claimed, found, row, err := dbx.ClaimKeyRestore(ctx, tx, dbx.SnapshotBeforeClaim(opts), claimTimeout, start, arg)
		return tx, claimed, found, row, err
	}
	for i, tc := range []struct {
		name  string
		claim claimFunc
	}{
		{"read committed", pipelined(pgx.TxOptions{})},
		{"repeatable read", pipelined(pgx.TxOptions{IsoLevel: pgx.RepeatableRead})},
		{"custom BeginQuery", custom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := func(k string) db.ClaimKeyParams {
				return db.ClaimKeyParams{Scope: "s", Key: k + "-" + tc.name, LockID: int64(1000*i) + int64(len(k))}
			}
			exp := key("expired")
			pgtest.Exec(t, pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at)
				VALUES ('s', '', '`+exp.Key+`', '\x01', now() - interval '1 second')`)
			// claim runs the claim on a connection of its own; end rolls its
			// transaction back and returns the connection.
			var end func()
			claim := func(arg db.ClaimKeyParams) (tx pgx.Tx, claimed, found bool, row db.GetKeyRow, err error) {
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				tx, claimed, found, row, err = tc.claim(cctx, conn.Conn(), arg)
				end = func() {
					if tx != nil {
						_ = tx.Rollback(ctx)
					}
					cancel()
					conn.Release()
				}
				t.Cleanup(end)
				return tx, claimed, found, row, err
			}
			lockTimeout := func(tx pgx.Tx) {
				t.Helper()
				var got string
				if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if got != session {
					t.Errorf("lock_timeout after the claim = %q, want the session's %q", got, session)
				}
			}
			rowLocked := func(k string) bool {
				t.Helper()
				_, err := pool.Exec(ctx, `SELECT 1 FROM idem_keys WHERE key = $1 FOR UPDATE NOWAIT`, k)
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
					return true
				}
				if err != nil {
					t.Fatal(err)
				}
				return false
			}

			// A purge holds the expired row: the claim's wait on it is
			// bounded by the claim's lock_timeout.
			release := lockTable(t, pool, `SELECT 1 FROM idem_keys WHERE key = '`+exp.Key+`' FOR UPDATE`)
			start := time.Now()
			tx, _, _, _, err := claim(exp)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
				t.Fatalf("claim of an expired row locked elsewhere: %v after %v, want lock_not_available (55P03) after %v", err, time.Since(start), claimTimeout)
			}
			end()
			release()

			// Taken over: the row is locked by the claim, lock_timeout is back.
			tx, claimed, found, row, err := claim(exp)
			if err != nil || !claimed || !found || row.Live {
				t.Fatalf("expired key: claimed %v found %v live %v err %v, want claimed an expired row", claimed, found, row.Live, err)
			}
			if !rowLocked(exp.Key) {
				t.Error("the expired row taken over is not locked by the claim")
			}
			lockTimeout(tx)
			end()

			// In flight elsewhere (another transaction holds the advisory
			// lock): the expired row is read, not locked.
			hold := lockTable(t, pool, `SELECT pg_advisory_xact_lock(`+itoa(exp.LockID)+` # 'idem_keys'::regclass::oid::bigint)`)
			tx, claimed, found, row, err = claim(exp)
			if err != nil || claimed || !found || row.Live {
				t.Fatalf("expired key in flight elsewhere: claimed %v found %v live %v err %v", claimed, found, row.Live, err)
			}
			if rowLocked(exp.Key) {
				t.Error("the claim locked the expired row of a key in flight elsewhere")
			}
			lockTimeout(tx)
			end()
			hold()

			// A new key: no row, lock_timeout back all the same.
			tx, claimed, found, _, err = claim(key("new"))
			if err != nil || !claimed || found {
				t.Fatalf("new key: claimed %v found %v err %v", claimed, found, err)
			}
			lockTimeout(tx)
			end()

			// A live row: a replay, nothing locked.
			live := db.ClaimKeyParams{Scope: "s", Key: "live", LockID: int64(1000*i) + 999}
			tx, claimed, found, row, err = claim(live)
			if err != nil || claimed || !found || !row.Live || row.StatusCode != 201 {
				t.Fatalf("live key: claimed %v found %v row %+v err %v", claimed, found, row, err)
			}
			if rowLocked("live") {
				t.Error("the claim locked a live row")
			}
			lockTimeout(tx)
			end()
		})
	}
}

func itoa(n int64) string { return fmt.Sprint(n) }
