package admin_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/admin"
)

// Outside review (isoattack): the operator commands with the session's
// default_transaction_isolation at repeatable read or serializable (a
// server, database or role may set it). Their statements wait on a row
// lock held by a concurrent replay, requeue or discard and then read what
// that transaction left, which a snapshot level refuses with 40001 once
// the other transaction committed: a second operator's replay failed with
// "could not serialize access" instead of finding the dead letter
// replayed, a discard racing a replay failed, and a purge by id racing a
// requeue failed instead of deleting nothing.
func TestSessionDefaultIsolationOperatorRaces(t *testing.T) {
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			pool := migrated(t, func(c *pgxpool.Config) {
				c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
				c.MaxConns = 12
			})
			a := admin.New(pool)
			ctx := context.Background()
			insert := func() int64 {
				pgtest.Exec(t, pool, `DELETE FROM idem_dead_letters;
INSERT INTO idem_dead_letters (context, topic, kpartition, koffset, record_key, value, attempts, last_error)
VALUES ('billing', 'orders', 0, 7, 'k', 'v', 5, 'boom')`)
				return pgtest.Count(t, pool, `SELECT id FROM idem_dead_letters`)
			}

			// Concurrent replays: one produces, the others find it replayed.
			id := insert()
			var produced, replayed atomic.Int64
			var wg sync.WaitGroup
			for i := 0; i < 6; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ok, err := a.ReplayDeadLetter(ctx, id, func(context.Context, admin.DeadLetter) error {
						produced.Add(1)
						time.Sleep(50 * time.Millisecond)
						return nil
					})
					if err != nil {
						t.Errorf("concurrent replay: %v", err)
					}
					if ok {
						replayed.Add(1)
					}
				}()
			}
			wg.Wait()
			if produced.Load() != 1 || replayed.Load() != 1 {
				t.Fatalf("6 concurrent replays produced %d times, %d reported replayed; want 1 and 1", produced.Load(), replayed.Load())
			}

			// A discard waiting on a replay's mark deletes the replayed row.
			id = insert()
			entered := make(chan struct{})
			done := make(chan error, 1)
			go func() {
				_, err := a.ReplayDeadLetter(ctx, id, func(context.Context, admin.DeadLetter) error {
					close(entered)
					waitLockWaiter(t, pool, "idem_dead_letters", "the discard never waited on the replay's row")
					return nil
				})
				done <- err
			}()
			<-entered
			ok, err := a.DiscardDeadLetter(ctx, id)
			if rerr := <-done; rerr != nil {
				t.Fatalf("replay: %v", rerr)
			}
			if err != nil || !ok {
				t.Fatalf("discard racing a replay: %v, %v; want the replayed row deleted", ok, err)
			}

			// A purge by id waiting on a requeue of the row deletes nothing.
			pgtest.Exec(t, pool, `INSERT INTO idem_outbox (topic, payload, status, parked_at) VALUES ('t', 'p', 'PARKED', now())`)
			oid := pgtest.Count(t, pool, `SELECT max(id) FROM idem_outbox`)
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `UPDATE idem_outbox SET status = 'PENDING', parked_at = NULL WHERE id = $1`, oid); err != nil {
				t.Fatal(err)
			}
			purged := make(chan error, 1)
			var n int64
			go func() {
				var err error
				n, err = a.PurgeParked(ctx, oid)
				purged <- err
			}()
			waitLockWaiter(t, pool, "idem_outbox", "the purge never waited on the requeued row")
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-purged; err != nil || n != 0 {
				t.Fatalf("purge by id racing a requeue: %d, %v; want 0 rows, no error", n, err)
			}
		})
	}
}

// waitLockWaiter waits until a session waits for another transaction's
// lock on a row of table (in the pool's schema: pg_locks is the server's,
// and tests elsewhere wait on rows too); what says who, for the failure.
func waitLockWaiter(t *testing.T, pool *pgxpool.Pool, table, what string) {
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if pgtest.Count(t, pool, `SELECT count(*) FROM pg_locks w WHERE w.locktype = 'transactionid' AND NOT w.granted
			AND EXISTS (SELECT 1 FROM pg_locks r WHERE r.pid = w.pid AND r.relation = '`+table+`'::regclass)`) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Error(what)
			return
		}
	}
}
