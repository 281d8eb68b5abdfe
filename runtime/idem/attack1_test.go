package idem_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// attack1 (issue 11, StoreNewKey): a function that writes its own key's
// row into idem_keys, expired (a hand-rolled reservation, a repair helper),
// was stored over by StoreKey's ON CONFLICT, which takes an expired row
// over: one run, 201. StoreNewKey's plain INSERT met that row with a unique
// violation at every attempt (the row is the function's own, rolled back
// with it, and written again by the next run), so the function ran again
// and again until the wait ran out and the client was told the key was in
// flight (409), which it never was. After a StoreNewKey met a row, the
// request's next attempts store with StoreKey.
func TestStoreNewKeyOverTheFunctionsOwnExpiredRow(t *testing.T) {
	e := newEnv(t)
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		_, err := tx.Exec(ctx, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
			VALUES ('test.charge', '', 'k-own', '\x00'::bytea, 201, '{}', '{"own":true}', now() - interval '1 second')
			ON CONFLICT DO NOTHING`)
		return err
	}
	h := e.handler(idem.Endpoint{Wait: 2 * time.Second})
	r := do(h, "k-own", body1)
	if r.status != http.StatusCreated || e.effects() != 1 {
		t.Fatalf("answer %d %s with %d effects (function ran %d times), want 201 and one effect",
			r.status, r.body, e.effects(), e.calls.Load())
	}
	if n := e.calls.Load(); n > 2 {
		t.Fatalf("function ran %d times, want at most 2 (StoreNewKey's, then StoreKey's)", n)
	}
	if r := do(h, "k-own", body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("second request: %d replayed=%q, want the replay", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if e.effects() != 1 {
		t.Fatalf("%d effects after the replay, want 1", e.effects())
	}
}

// attack1 (issue 11, StoreNewKey): the unique violation that means "the
// key's row was written elsewhere" was recognised by the constraint's name,
// idem_keys_pkey, which is only PostgreSQL's default: an idem_keys created
// again after an earlier one was renamed aside (a manual repair keeping the
// old table: its index keeps the name) has its primary key named
// idem_keys_pkey1. A row completed elsewhere then answered the client with
// a failure where StoreKey's ON CONFLICT (which names no constraint) led to
// the replay (here the key's other request: 422).
func TestStoreNewKeyConflictWhateverThePrimaryKeyIsNamed(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	pgtest.Exec(t, e.pool, `ALTER TABLE idem_keys RENAME TO idem_keys_aside`)
	pgtest.Exec(t, e.pool, `CREATE TABLE idem_keys (LIKE idem_keys_aside INCLUDING ALL)`)
	var name string
	if err := e.pool.QueryRow(ctx, `SELECT conname FROM pg_constraint WHERE conrelid = 'idem_keys'::regclass AND contype = 'p'`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	if name == "idem_keys_pkey" {
		t.Fatalf("primary key named %s: the test needs another name", name)
	}
	var once sync.Once
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		once.Do(func() {
			pgtest.Exec(t, e.pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, status_code, headers, body, expires_at)
				VALUES ('test.charge', '', 'k-renamed', '\x00'::bytea, 201, '{}', '{"elsewhere":true}', now() + interval '1 hour')`)
		})
		return nil
	}
	h := e.handler(idem.Endpoint{Wait: 2 * time.Second})
	r := do(h, "k-renamed", body1)
	if r.status != http.StatusUnprocessableEntity || e.effects() != 0 {
		t.Fatalf("answer %d %s with %d effects (primary key %s), want 422 (the row written elsewhere) and none",
			r.status, r.body, e.effects(), name)
	}
}
