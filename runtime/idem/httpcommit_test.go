package idem_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Outside review: the function succeeds, and the COMMIT fails because of
// its own writes — a DEFERRABLE INITIALLY DEFERRED unique (23505) or foreign
// key (23503) constraint, or a deferred constraint trigger raising an
// exception, checked only at COMMIT. That was a 503 "storage unavailable;
// retry later" with Retry-After: the client was told to retry a request that
// fails the same way every time, and the operator saw an outage. It is the
// status the same error gets when the function's own statement raises it
// (the constraint checked at once, SET CONSTRAINTS ALL IMMEDIATE): a 500
// problem, no Retry-After. The COMMIT rolled back, so nothing is stored and
// the key is not left claimed: once the conflict is removed, a retry with
// the same key runs the function and succeeds, exactly once.
func TestDeferredConstraintAtCommitIsNotOutage(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		schema  string // run in the test's schema; conflicts with orders o-1 and o-2
		write   string // the function's write, $1 = the order
		resolve string // removes o-1's conflict
		code    string // the SQLSTATE at COMMIT
	}{
		"unique 23505": {
			schema:  `CREATE TABLE uniq (v text, UNIQUE (v) DEFERRABLE INITIALLY DEFERRED); INSERT INTO uniq VALUES ('o-1'), ('o-2')`,
			write:   `INSERT INTO uniq VALUES ($1)`,
			resolve: `DELETE FROM uniq WHERE v = 'o-1'`,
			code:    "23505",
		},
		"foreign key 23503": {
			schema: `CREATE TABLE parent (id text PRIMARY KEY);
				CREATE TABLE child (parent text REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`,
			write:   `INSERT INTO child VALUES ($1)`,
			resolve: `INSERT INTO parent VALUES ('o-1')`,
			code:    "23503",
		},
		"deferred trigger raises": {
			schema: `CREATE TABLE blocked (v text);
				INSERT INTO blocked VALUES ('o-1'), ('o-2');
				CREATE TABLE audited (v text);
				CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF EXISTS (SELECT 1 FROM blocked WHERE v = NEW.v) THEN
						RAISE EXCEPTION 'order % is blocked', NEW.v;
					END IF;
					RETURN NULL;
				END $$;
				CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON audited DEFERRABLE INITIALLY DEFERRED
					FOR EACH ROW EXECUTE FUNCTION refuse()`,
			write:   `INSERT INTO audited VALUES ($1)`,
			resolve: `DELETE FROM blocked WHERE v = 'o-1'`,
			code:    "P0001",
		},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			logs := &lockedBuffer{}
			e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			pgtest.Exec(t, e.pool, c.schema)
			var immediate atomic.Bool
			e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
				if immediate.Load() {
					if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err != nil {
						return err
					}
				}
				_, err := tx.Exec(ctx, c.write, req.Order)
				return err
			}
			h := e.handler(idem.Endpoint{})

			// The same error raised by the function's own statement: the
			// status a refusal at COMMIT must get too.
			immediate.Store(true)
			own := do(h, "k-immediate", body1)
			immediate.Store(false)
			if own.status != http.StatusInternalServerError || e.calls.Load() != 1 {
				t.Fatalf("the function's own statement failing: %d %s after %d calls, want a 500", own.status, own.body, e.calls.Load())
			}

			r := do(h, "k-deferred", body1)
			if e.calls.Load() != 2 {
				t.Fatalf("%d calls, want 2", e.calls.Load())
			}
			wantProblem(t, r, own.status)
			if ra := r.header.Get("Retry-After"); ra != "" {
				t.Fatalf("COMMIT refused the function's writes: Retry-After %q, want none (a retry fails the same way)", ra)
			}
			if strings.Contains(string(r.body), "storage unavailable") {
				t.Fatalf("COMMIT refused the function's writes: answered as an outage: %s", r.body)
			}
			if !strings.Contains(logs.String(), c.code) || strings.Contains(logs.String(), "idempotency storage failed") {
				t.Fatalf("log should carry the function's failure (%s), not a storage failure:\n%s", c.code, logs)
			}
			if e.effects() != 0 || e.keys() != 0 {
				t.Fatalf("after the refused COMMIT: %d effects, %d keys, want 0, 0", e.effects(), e.keys())
			}

			// The key was not left claimed: once the conflict is removed,
			// the retry with the same key runs the function and commits.
			pgtest.Exec(t, e.pool, c.resolve)
			r = do(h, "k-deferred", body1)
			if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
				t.Fatalf("retry after the conflict was removed: %d %s, want 201 from a run", r.status, r.body)
			}
			if e.calls.Load() != 3 || e.effects() != 1 || e.keys() != 1 {
				t.Fatalf("retry: %d calls, %d effects, %d keys, want 3, 1, 1", e.calls.Load(), e.effects(), e.keys())
			}
			again := do(h, "k-deferred", body1)
			if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" || e.calls.Load() != 3 {
				t.Fatalf("second retry: %d %s after %d calls, want the replay", again.status, again.body, e.calls.Load())
			}

			// Without a key (o-2 still conflicts): the same answer, nothing
			// committed.
			noKey := e.handler(idem.Endpoint{Scope: "test.nokey", KeyOptional: true})
			r = do(noKey, "", `{"order":"o-2","amount":100}`)
			if e.calls.Load() != 4 {
				t.Fatalf("%d calls, want 4", e.calls.Load())
			}
			wantProblem(t, r, own.status)
			if r.header.Get("Retry-After") != "" || e.effects() != 1 {
				t.Fatalf("without a key: %d %s, Retry-After %q, %d effects; want %d, none, 1 (the keyed one)", r.status, r.body, r.header.Get("Retry-After"), e.effects(), own.status)
			}
		})
	}
}

// What stays an outage at COMMIT: the server ending the session there (the
// function's deferred trigger terminates its own backend: FATAL 57P01 where
// the COMMIT's answer was due, the outcome unknown to the runtime) and an
// outage SQLSTATE raised at COMMIT (53100, disk full). Both are 503 with
// Retry-After, nothing committed, and the retry runs the function once.
func TestOutageAtCommitStays503(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"session terminated": `PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5);`,
		"disk full 53100":    `RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100';`,
	}
	for name, body := range cases {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			pgtest.Exec(t, e.pool, `CREATE FUNCTION fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN `+body+` RETURN NULL; END $$;
				CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
					FOR EACH ROW WHEN (NEW.amount = 100) EXECUTE FUNCTION fail_commit()`)
			h := e.handler(idem.Endpoint{})
			r := do(h, "k-outage", body1)
			wantProblem(t, r, http.StatusServiceUnavailable)
			if r.header.Get("Retry-After") == "" {
				t.Fatalf("outage at COMMIT: 503 without Retry-After: %s", r.body)
			}
			if e.effects() != 0 || e.keys() != 0 {
				t.Fatalf("after the outage: %d effects, %d keys, want 0, 0", e.effects(), e.keys())
			}
			pgtest.Exec(t, e.pool, `DROP TRIGGER fail_commit ON effects`)
			if r := do(h, "k-outage", body1); r.status != http.StatusCreated {
				t.Fatalf("retry: %d %s", r.status, r.body)
			}
			if e.calls.Load() != 2 || e.effects() != 1 || e.keys() != 1 {
				t.Fatalf("retry: %d calls, %d effects, %d keys, want 2, 1, 1", e.calls.Load(), e.effects(), e.keys())
			}
		})
	}
}
