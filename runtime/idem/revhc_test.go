package idem_test

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review (revhc) of 9dda099: what the database raises at COMMIT
// that is a transient condition (serialization failure, deadlock, lock
// timeout, statement timeout, cancel) must stay a 503 with Retry-After on
// both paths, with nothing committed and the key free; never a 500.
func TestRevhcTransientAtCommitStays503(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		trigger string // the body of the deferred trigger on effects
		setup   string // run by the function before its INSERT (SET LOCAL ...)
	}{
		"raised 40001": {trigger: `RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001';`},
		"raised 40P01": {trigger: `RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01';`},
		"raised 55P03": {trigger: `RAISE EXCEPTION 'lock timeout' USING ERRCODE = '55P03';`},
		"raised 57014": {trigger: `RAISE EXCEPTION 'canceling statement' USING ERRCODE = '57014';`},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			logs := &lockedBuffer{}
			e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			pgtest.Exec(t, e.pool, `CREATE FUNCTION fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN `+c.trigger+` RETURN NULL; END $$;
				CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
					FOR EACH ROW WHEN (NEW.amount = 100) EXECUTE FUNCTION fail_commit()`)
			if c.setup != "" {
				e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
					_, err := tx.Exec(ctx, c.setup)
					return err
				}
			}
			for _, key := range []string{"k-transient", ""} {
				ep := idem.Endpoint{}
				if key == "" {
					ep = idem.Endpoint{Scope: "test.nokey", KeyOptional: true}
				}
				r := do(e.handler(ep), key, body1)
				if key != "" && r.status == http.StatusConflict && (strings.HasSuffix(name, "40001") || strings.HasSuffix(name, "40P01")) {
					// Keyed 40001/40P01 are retried until the wait runs
					// out; answered "Request in flight" (pre-existing, see
					// the report), still with Retry-After.
					wantProblem(t, r, http.StatusConflict)
				} else {
					wantProblem(t, r, http.StatusServiceUnavailable)
				}
				if r.header.Get("Retry-After") == "" {
					t.Fatalf("key %q: transient failure at COMMIT answered without Retry-After: %s", key, r.body)
				}
				if strings.Contains(logs.String(), "idempotent handler failed") {
					t.Fatalf("key %q: transient failure at COMMIT logged as the function's failure:\n%s", key, logs)
				}
				if e.effects() != 0 || e.keys() != 0 {
					t.Fatalf("key %q: %d effects, %d keys, want 0, 0", key, e.effects(), e.keys())
				}
			}
			// The key is free: with the cause gone, one run, then a replay.
			pgtest.Exec(t, e.pool, `DROP TRIGGER fail_commit ON effects`)
			before := e.calls.Load()
			h := e.handler(idem.Endpoint{})
			if r := do(h, "k-transient", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
				t.Fatalf("retry: %d %s", r.status, r.body)
			}
			if r := do(h, "k-transient", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("second retry: %d %s, want a replay", r.status, r.body)
			}
			if e.calls.Load() != before+1 || e.effects() != 1 || e.keys() != 1 {
				t.Fatalf("retries: %d calls (want %d), %d effects, %d keys", e.calls.Load(), before+1, e.effects(), e.keys())
			}
		})
	}
}

// A refusal at COMMIT is rendered as a function error is: problem+json,
// no SQL message, constraint or table name in a 500; for class 22 the same
// 422 (and detail) the function's own statement gets; the 500 is logged at
// ERROR once per request, not folded with storage failures.
func TestRevhcRefusedCommitRendering(t *testing.T) {
	e := newEnv(t)
	logs := &lockedBuffer{}
	e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	e.cfg.FailureLogInterval = time.Hour // storage failures would fold into one line
	pgtest.Exec(t, e.pool, `CREATE TABLE uniq_secret (v text, CONSTRAINT uniq_secret_constraint UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO uniq_secret VALUES ('o-1');
		CREATE TABLE bad22 (v text);
		CREATE FUNCTION raise22() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'value secret22 out of range' USING ERRCODE = '22003'; END $$;
		CREATE CONSTRAINT TRIGGER raise22 AFTER INSERT ON bad22 DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW EXECUTE FUNCTION raise22()`)
	var table atomic.Value
	var immediate atomic.Bool
	e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
		if immediate.Load() {
			if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err != nil {
				return err
			}
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+table.Load().(string)+` VALUES ($1)`, req.Order)
		return err
	}
	h := e.handler(idem.Endpoint{})

	table.Store("uniq_secret")
	for i, key := range []string{"k-500-a", "k-500-b", "k-500-c"} {
		r := do(h, key, body1)
		wantProblem(t, r, http.StatusInternalServerError)
		for _, leak := range []string{"uniq_secret", "duplicate key", "23505", "commit"} {
			if strings.Contains(string(r.body), leak) {
				t.Fatalf("500 body leaks %q: %s", leak, r.body)
			}
		}
		if n := strings.Count(logs.String(), "level=ERROR msg=\"idempotent handler failed\""); n != i+1 {
			t.Fatalf("after %d refused COMMITs: %d ERROR lines \"idempotent handler failed\", want %d:\n%s", i+1, n, i+1, logs)
		}
	}
	if strings.Contains(logs.String(), "idempotency storage failed") {
		t.Fatalf("refused COMMIT logged as storage failure:\n%s", logs)
	}

	table.Store("bad22")
	immediate.Store(true)
	own := do(h, "k-22-immediate", body1)
	immediate.Store(false)
	wantProblem(t, own, http.StatusUnprocessableEntity)
	r := do(h, "k-22-deferred", body1)
	wantProblem(t, r, http.StatusUnprocessableEntity)
	if string(r.body) != string(own.body) || r.header.Get("Retry-After") != "" {
		t.Fatalf("class 22 at COMMIT: %s (Retry-After %q), want the statement's own %s", r.body, r.header.Get("Retry-After"), own.body)
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys, want 0, 0", e.effects(), e.keys())
	}
}

// Concurrent duplicates of one key while the COMMIT is refused: each gets a
// failure (500, or 409 in flight), none a 201 or a replay of a response
// that never committed, and nothing is left behind.
func TestRevhcConcurrentDuplicatesOfRefusedCommit(t *testing.T) {
	e := newEnv(t)
	pgtest.Exec(t, e.pool, `CREATE TABLE uniq (v text, UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO uniq VALUES ('o-1')`)
	e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
		_, err := tx.Exec(ctx, `INSERT INTO uniq VALUES ($1)`, req.Order)
		return err
	}
	h := e.handler(idem.Endpoint{})
	const n = 8
	results := make([]result, n)
	// Half share one engine (the local flight), half are engines of their
	// own, as replicas (the key's lock in the database).
	hs := make([]http.Handler, n)
	for i := range n {
		hs[i] = h
		if i%2 == 1 {
			hs[i] = e.handler(idem.Endpoint{})
		}
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = do(hs[i], "k-dup", body1)
		}()
	}
	wg.Wait()
	for i, r := range results {
		if r.status != http.StatusInternalServerError && r.status != http.StatusConflict {
			t.Fatalf("duplicate %d: %d %s (replayed %q), want 500 or 409", i, r.status, r.body, r.header.Get("Idempotent-Replayed"))
		}
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys, want 0, 0", e.effects(), e.keys())
	}
	pgtest.Exec(t, e.pool, `DELETE FROM uniq`)
	before := e.calls.Load()
	if r := do(h, "k-dup", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s", r.status, r.body)
	}
	if e.calls.Load() != before+1 || e.effects() != 1 || e.keys() != 1 {
		t.Fatalf("retry: %d calls (want %d), %d effects, %d keys", e.calls.Load(), before+1, e.effects(), e.keys())
	}
}

// The client goes away while COMMIT runs a deferred trigger (blocked on an
// advisory lock the test holds): the answer is not the function's failure
// (no 500, no "idempotent handler failed"), the handler's error keeps
// context.Canceled, nothing commits and the key is free.
func TestRevhcClientGoneDuringCommit(t *testing.T) {
	for _, key := range []string{"k-gone", ""} {
		t.Run("key="+key, func(t *testing.T) {
			e := newEnv(t)
			logs := &lockedBuffer{}
			e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			lockID := int64(0x72657668) + int64(len(key))
			pgtest.Exec(t, e.pool, `CREATE FUNCTION wait_commit() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN PERFORM pg_advisory_xact_lock(`+strconv.FormatInt(lockID, 10)+`); RETURN NULL; END $$;
				CREATE CONSTRAINT TRIGGER wait_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
					FOR EACH ROW WHEN (NEW.amount = 100) EXECUTE FUNCTION wait_commit()`)
			// COMMIT's trigger waits for the lock when the client goes.
			h, holder, r := cancelledWhileBlocked(t, e, key, lockID)
			if _, err := holder.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, lockID); err != nil {
				t.Fatal(err)
			}
			holder.Release()
			if r.status == http.StatusInternalServerError || strings.Contains(logs.String(), "idempotent handler failed") {
				t.Fatalf("client gone answered as the function's failure: %d %s\n%s", r.status, r.body, logs)
			}
			if r.status < 500 {
				t.Fatalf("client gone during COMMIT: %d %s", r.status, r.body)
			}
			// Let a possibly still-running backend finish before counting.
			deadline := time.Now().Add(20 * time.Second)
			for pgtest.Count(t, e.pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = $1`, uint32(lockID)) != 0 {
				if time.Now().After(deadline) {
					t.Fatal("the lock is still held or waited for")
				}
				time.Sleep(10 * time.Millisecond)
			}
			// The backend, unaware the client left, may finish the COMMIT
			// once the lock is free: the runtime said so ("Outcome
			// unknown"); the effect and the key commit together or not.
			if !strings.Contains(string(r.body), "Outcome unknown") && !strings.Contains(string(r.body), "cancelled") {
				t.Fatalf("client gone during COMMIT: %d %s", r.status, r.body)
			}
			committed := e.effects()
			if key != "" && e.keys() != committed {
				t.Fatalf("%d effects but %d keys after a cancelled COMMIT", committed, e.keys())
			}
			if key != "" {
				before := e.calls.Load()
				r := do(h, key, body1)
				replayed := r.header.Get("Idempotent-Replayed") == "true"
				if r.status != http.StatusCreated || replayed != (committed == 1) {
					t.Fatalf("retry after %d committed: %d %s replayed %v", committed, r.status, r.body, replayed)
				}
				if e.effects() != 1 || e.keys() != 1 || e.calls.Load() != before+1-committed {
					t.Fatalf("retry: %d calls (before %d), %d effects, %d keys", e.calls.Load(), before, e.effects(), e.keys())
				}
			}
		})
	}
}

// As TestRevhcClientGoneDuringCommit, with a pool whose context watcher
// sends a cancel request (pgconn.CancelRequestContextWatcherHandler, a
// common pgx configuration): the server ends the COMMIT with 57014 and
// the connection stays open. Not the function's failure; nothing commits.
func TestRevhcClientGoneDuringCommitCancelRequest(t *testing.T) {
	clientGoneCancelRequest(t, 0x72657600, func(t *testing.T, e *env, lockID int64) {
		pgtest.Exec(t, e.pool, `CREATE FUNCTION wait_commit() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN PERFORM pg_advisory_xact_lock(`+strconv.FormatInt(lockID, 10)+`); RETURN NULL; END $$;
			CREATE CONSTRAINT TRIGGER wait_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW WHEN (NEW.amount = 100) EXECUTE FUNCTION wait_commit()`)
	})
}

// As TestRevhcClientGoneDuringCommitCancelRequest, the client gone while
// the function's own statement runs: the server ends that statement with
// 57014 and the connection stays open. Not the function's failure; nothing
// commits.
func TestRevhcClientGoneDuringStatementCancelRequest(t *testing.T) {
	clientGoneCancelRequest(t, 0x72657610, func(_ *testing.T, e *env, lockID int64) {
		e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
			_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lockID)
			return err
		}
	})
}

// clientGoneCancelRequest runs a request, with a key and without, on a
// pool whose context watcher sends a cancel request; block makes the
// request wait for the advisory lock lockID (held here) at the point under
// test. Once the request waits, its context is cancelled: the answer must
// be the cancellation's 503, logged neither as the function's failure nor
// as a storage failure, with nothing committed.
func clientGoneCancelRequest(t *testing.T, lockBase int64, block func(t *testing.T, e *env, lockID int64)) {
	for _, key := range []string{"k-gone", ""} {
		t.Run("key="+key, func(t *testing.T) {
			pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
				c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
					return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
				}
			})
			e := newEnvPool(t, pool)
			logs := &lockedBuffer{}
			e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			lockID := lockBase + int64(len(key))
			block(t, e, lockID)
			_, holder, r := cancelledWhileBlocked(t, e, key, lockID)
			defer holder.Release()
			defer holder.Exec(context.Background(), `SELECT pg_advisory_unlock_all()`)
			t.Logf("answer %d %s\nlog:\n%s", r.status, r.body, logs)
			if r.status == http.StatusInternalServerError || strings.Contains(logs.String(), "idempotent handler failed") {
				t.Fatalf("client gone answered as the function's failure: %d %s\n%s", r.status, r.body, logs)
			}
			if r.status != http.StatusServiceUnavailable || !strings.Contains(string(r.body), "request cancelled") ||
				strings.Contains(logs.String(), "idempotency storage failed") {
				t.Fatalf("client gone: %d %s, want the cancellation 503 and no storage-failure log:\n%s", r.status, r.body, logs)
			}
			if e.effects() != 0 || e.keys() != 0 {
				t.Fatalf("%d effects, %d keys after a cancelled request, want 0, 0", e.effects(), e.keys())
			}
		})
	}
}

// cancelledWhileBlocked holds the advisory lock lockID on a connection of
// its own (holder, returned still holding it), sends key's request (no key:
// an endpoint where it is optional) and, once the request's backend waits
// for that lock, cancels the request's context. It returns the handler, the
// holder and the answer.
func cancelledWhileBlocked(t *testing.T, e *env, key string, lockID int64) (http.Handler, *pgxpool.Conn, result) {
	t.Helper()
	holder, err := e.pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, lockID); err != nil {
		holder.Release()
		t.Fatal(err)
	}
	ep := idem.Endpoint{}
	if key == "" {
		ep = idem.Endpoint{Scope: "test.nokey", KeyOptional: true}
	}
	h := e.handler(ep)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	go func() { done <- doCtx(ctx, h, key, body1) }()
	deadline := time.Now().Add(20 * time.Second)
	for pgtest.Count(t, e.pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1`, uint32(lockID)) == 0 {
		if time.Now().After(deadline) {
			cancel()
			holder.Release()
			t.Fatal("the request never waited for the lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	return h, holder, <-done
}
