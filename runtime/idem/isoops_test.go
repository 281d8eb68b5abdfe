package idem_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (isoattack): the janitor with the session's
// default_transaction_isolation at repeatable read or serializable. Its
// DELETE of expired keys skips a row a takeover holds (SKIP LOCKED), and
// under read committed re-checks a row a takeover completed meanwhile; a
// snapshot level refuses the latter with 40001, which failed the whole run
// ("retrying at the next interval", 5 minutes by default), the processed
// events, published outbox rows and dead letters after it not purged.
//
// The window is made wide: the takeover's transaction holds a SHARE lock on
// idem_keys, which the janitor's DELETE waits for after its snapshot (its
// statements prepared by a first run, as on a long-lived connection).
func TestSessionDefaultIsolationJanitorRacingATakeover(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			pool, other := levelPools(t, level, 1)
			ctx := context.Background()
			j, err := idem.NewJanitor(idem.NewStore(pool), idem.JanitorConfig{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := j.RunOnce(ctx); err != nil { // prepares its statements
				t.Fatal(err)
			}
			pgtest.Exec(t, other, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, expires_at)
VALUES ('s', 'p', 'taken', '\x00', 200, now() - interval '1 minute'), ('s', 'p', 'old', '\x00', 200, now() - interval '1 minute');
INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset, processed_at)
VALUES ('c', 'e', 't', 0, 1, now() - interval '8 days')`)
			// A request takes 'taken' over and completes it.
			tx := holdTx(t, other, `UPDATE idem_keys SET expires_at = now() + interval '1 hour' WHERE key = 'taken'`)
			if _, err := tx.Exec(ctx, `LOCK TABLE idem_keys IN SHARE MODE`); err != nil {
				t.Fatal(err)
			}
			type result struct {
				run idem.JanitorRun
				err error
			}
			done := make(chan result, 1)
			go func() {
				run, err := j.RunOnce(ctx)
				done <- result{run, err}
			}()
			waitLockWait(t, other, `relation = 'idem_keys'::regclass`, "the janitor never waited for idem_keys")
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil {
				t.Fatalf("janitor run racing a takeover: %v", r.err)
			}
			if n := pgtest.Count(t, other, `SELECT count(*) FROM idem_keys WHERE key = 'taken'`); n != 1 {
				t.Fatal("the janitor deleted a key taken over and live again")
			}
			if n := pgtest.Count(t, other, `SELECT count(*) FROM idem_keys WHERE key = 'old'`); n != 0 {
				t.Fatal("the janitor kept an expired key")
			}
			if n := pgtest.Count(t, other, `SELECT count(*) FROM idem_processed_events`); n != 0 {
				t.Fatal("the janitor kept an old processed event")
			}
		})
	}
}

// Outside review (isoattack): Store.RequeueAllParked with the session's
// default isolation at repeatable read or serializable, waiting on a parked
// row that another requeue returns to PENDING: under read committed it
// re-checks the row and requeues nothing; a snapshot level refused it with
// 40001, an operator's requeue failed for a race it was meant to lose
// quietly (under serializable it also failed with "read/write
// dependencies" against the relay's claims: TestRequeueParkedRacingRelay
// with DATABASE_URL ...&default_transaction_isolation=serializable).
func TestSessionDefaultIsolationRequeueRacingARequeue(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			pool, other := levelPools(t, level, 0)
			ctx := context.Background()
			pgtest.Exec(t, other, `INSERT INTO idem_outbox (topic, payload, status, parked_at) VALUES ('t', 'p', 'PARKED', now())`)
			tx := holdTx(t, other, `UPDATE idem_outbox SET status = 'PENDING', parked_at = NULL WHERE status = 'PARKED'`)
			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := idem.NewStore(pool).RequeueAllParked(ctx)
				done <- result{n, err}
			}()
			waitLockWait(t, other, rowLockOn("idem_outbox"), "the requeue never waited for the row")
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if r := <-done; r.err != nil || r.n != 0 {
				t.Fatalf("requeue racing a requeue: %d, %v; want 0 rows, no error", r.n, r.err)
			}
		})
	}
}

// Outside review (isoattack): processes starting at once call Migrate on a
// new schema with the session's default isolation at repeatable read or
// serializable. One applies the schema; the others wait for its advisory
// lock, which their transaction requested after taking its snapshot, so
// they read no schema version and apply the schema again, which fails
// ("migrate: apply schema: ERROR: relation \"idem_keys_expires_at\" already
// exists (SQLSTATE 42P07)"): all replicas but one failed to start.
func TestSessionDefaultIsolationConcurrentMigrate(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			url := pgtest.Schema(t)
			const n = 4
			pools := make([]*pgxpool.Pool, n)
			for i := range pools {
				pools[i] = pgtest.PoolURL(t, url, func(c *pgxpool.Config) {
					c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
				})
				if err := pools[i].Ping(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
			start := make(chan struct{})
			errs := make(chan error, n)
			for _, p := range pools {
				go func() {
					<-start
					errs <- idem.Migrate(context.Background(), p)
				}()
			}
			close(start)
			for range n {
				if err := <-errs; err != nil {
					t.Errorf("concurrent Migrate: %v", err)
				}
			}
		})
	}
}

// Outside review (isoattack): a standby relay with the session's default
// isolation at repeatable read or serializable, whose lease statement
// waits on the lease row while the leader renews it. Its transaction's
// snapshot (taken by SetRelayStatementTimeout, a round trip earlier) is
// older than the renewal, and AcquireRelayLease's ON CONFLICT DO UPDATE
// failed with 40001, logged as "relay lease: cannot reach the database;
// retrying" (a warning about a database that answered) and backed off,
// where read committed re-checks the row and stands by.
func TestSessionDefaultIsolationStandbyRacingARenewal(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			pool, other := levelPools(t, level, 0)
			ctx := context.Background()
			pgtest.Exec(t, other, `INSERT INTO idem_relay_leader (name, holder, token, expires_at) VALUES ('idem_outbox', 'leader', 'tok', now() + interval '1 minute')`)
			renewal := holdTx(t, other, `UPDATE idem_relay_leader SET expires_at = now() + interval '1 minute' WHERE name = 'idem_outbox'`)
			logs := runRelay(t, pool)
			waitLockWait(t, other, rowLockOn("idem_relay_leader"), "the standby never waited on the lease row")
			if err := renewal.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, func() bool {
				return strings.Contains(logs.String(), "relay standing by") || strings.Contains(logs.String(), "cannot reach")
			})
			if s := logs.String(); strings.Contains(s, "cannot reach the database") {
				t.Fatalf("a standby racing the leader's renewal:\n%s", s)
			}
		})
	}
}

// Outside review (isoattack): Store.PurgeExpiredKeys, the janitor's
// expired-key DELETE as a library call, racing a takeover under the
// session's default isolation at repeatable read or serializable (as
// TestSessionDefaultIsolationJanitorRacingATakeover).
func TestSessionDefaultIsolationPurgeExpiredKeysRacingATakeover(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			pool, other := levelPools(t, level, 1)
			ctx := context.Background()
			store := idem.NewStore(pool)
			if _, err := store.PurgeExpiredKeys(ctx, 100); err != nil { // prepares its statement
				t.Fatal(err)
			}
			pgtest.Exec(t, other, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, expires_at)
VALUES ('s', 'p', 'taken', '\x00', 200, now() - interval '1 minute'), ('s', 'p', 'old', '\x00', 200, now() - interval '1 minute')`)
			tx := holdTx(t, other, `UPDATE idem_keys SET expires_at = now() + interval '1 hour' WHERE key = 'taken'`)
			if _, err := tx.Exec(ctx, `LOCK TABLE idem_keys IN SHARE MODE`); err != nil {
				t.Fatal(err)
			}
			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := store.PurgeExpiredKeys(ctx, 100)
				done <- result{n, err}
			}()
			waitLockWait(t, other, `relation = 'idem_keys'::regclass`, "the purge never waited for idem_keys")
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if r := <-done; r.err != nil || r.n != 1 {
				t.Fatalf("purge racing a takeover: %d, %v; want 1 (the expired key), no error", r.n, r.err)
			}
			if n := pgtest.Count(t, other, `SELECT count(*) FROM idem_keys`); n != 1 {
				t.Fatalf("%d keys left, want the one taken over", n)
			}
		})
	}
}

// The leader's claim (ClaimOutboxBatch, an autocommit statement) with the
// session's default isolation at repeatable read or serializable. It takes
// the lease row FOR SHARE, so it waits for a renewal in progress (the
// leader's own, every Lease/3), and its snapshot was taken before that
// wait: PostgreSQL refused it with 40001 once the renewal committed, and
// the relay logged "relay batch failed; backing off" and published late,
// at every renewal that met a claim. Now the relay's statements run at
// read committed, each in a transaction of its own pipelined with BEGIN
// and COMMIT (one round trip, as before).
func TestSessionDefaultIsolationClaimRacingARenewal(t *testing.T) {
	for _, level := range snapshotLevels {
		t.Run(level, func(t *testing.T) {
			pool, other := levelPools(t, level, 0)
			ctx := context.Background()
			logs := runRelay(t, pool)
			published := func(n int64) bool {
				return pgtest.Count(t, other, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`) == n
			}
			pgtest.Exec(t, other, `INSERT INTO idem_outbox (topic, payload) VALUES ('t', '\x00')`)
			waitFor(t, func() bool { return published(1) }) // the relay leads, its statements prepared

			// A renewal in progress holds the lease row when the next row
			// is claimed.
			renewal := holdTx(t, other, `UPDATE idem_relay_leader SET expires_at = expires_at + interval '1 second' WHERE name = 'idem_outbox'`)
			pgtest.Exec(t, other, `INSERT INTO idem_outbox (topic, payload) VALUES ('t', '\x01')`)
			waitLockWait(t, other, rowLockOn("idem_relay_leader"), "the claim never waited on the lease row")
			if err := renewal.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, func() bool { return published(2) || strings.Contains(logs.String(), "backing off") })
			if s := logs.String(); strings.Contains(s, "backing off") {
				t.Fatalf("a claim racing the leader's renewal:\n%s", s)
			}
		})
	}
}

// runRelay runs a relay on pool, publishing everything but key "bad", until
// the test ends; it returns the relay's log.
func runRelay(t *testing.T, pool *pgxpool.Pool) *syncBuffer {
	t.Helper()
	logs := &syncBuffer{}
	relay, err := idem.NewRelay(idem.NewStore(pool), ackAllBut{}, idem.RelayConfig{
		PollInterval: 20 * time.Millisecond,
		Logger:       slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return logs
}

// holdTx begins a transaction on pool that runs sql and stays open, holding
// its locks until the test commits it (or the test ends: rolled back).
func holdTx(t *testing.T, pool *pgxpool.Pool, sql string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, sql); err != nil {
		t.Fatal(err)
	}
	return tx
}
