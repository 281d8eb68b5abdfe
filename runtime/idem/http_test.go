package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

type chargeReq struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

type receipt struct {
	ID     int64  `json:"id"`
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

// env is one test's service: a fresh schema with idemgen's tables and an
// effects table the wrapped function writes to.
type env struct {
	t     *testing.T
	pool  *pgxpool.Pool
	cfg   idem.HTTPConfig // the engine's configuration, read by handler
	calls atomic.Int64
	// hook, if set, runs inside the wrapped function after its INSERT.
	hook func(ctx context.Context, tx pgx.Tx, req chargeReq) error
}

func newEnv(t *testing.T) *env {
	t.Helper()
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, order_id text NOT NULL, amount int NOT NULL)`)
	return &env{t: t, pool: pool}
}

// charge is the wrapped function: one INSERT, the side effect we count.
func (e *env) charge(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
	e.calls.Add(1)
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO effects (order_id, amount) VALUES ($1, $2) RETURNING id`, req.Order, req.Amount).Scan(&id); err != nil {
		return receipt{}, err
	}
	if e.hook != nil {
		if err := e.hook(ctx, tx, req); err != nil {
			return receipt{}, err
		}
	}
	idem.ResponseHeader(ctx).Set("Location", fmt.Sprintf("/charges/%d", id))
	idem.ResponseHeader(ctx).Set("Set-Cookie", "session=secret")
	idem.ResponseHeader(ctx).Set("X-Not-Allowed", "x")
	return receipt{ID: id, Order: req.Order, Amount: req.Amount}, nil
}

func (e *env) handler(ep idem.Endpoint) http.Handler {
	if ep.Scope == "" {
		ep.Scope = "test.charge"
	}
	if ep.Route == "" {
		ep.Route = "POST /charges"
	}
	if ep.Status == 0 {
		ep.Status = http.StatusCreated
	}
	return idem.Handle(e.engine(), ep, e.charge)
}

// engine is a new HTTP engine with e.cfg.
func (e *env) engine() *idem.HTTP {
	h, err := idem.NewHTTP(idem.NewStore(e.pool), e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return h
}

func (e *env) effects() int64 {
	return pgtest.Count(e.t, e.pool, `SELECT count(*) FROM effects`)
}

func (e *env) keys() int64 {
	return pgtest.Count(e.t, e.pool, `SELECT count(*) FROM idem_keys`)
}

// captureLogs sends the engine's log (e.cfg.Logger) to the returned buffer.
func (e *env) captureLogs() *lockedBuffer {
	logs := &lockedBuffer{}
	e.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	return logs
}

// hookUntilFixed makes fn the function's hook until fix is called; from
// then on the hook does nothing, so a retry after the failure runs clean.
func (e *env) hookUntilFixed(fn func(ctx context.Context, tx pgx.Tx) error) (fix func()) {
	var broken atomic.Bool
	broken.Store(true)
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if broken.Load() {
			return fn(ctx, tx)
		}
		return nil
	}
	return func() { broken.Store(false) }
}

// wantRetryRunsAgain checks that a failed request with key left nothing
// (no effect, no key) and, after fix, that the retry runs the function a
// second time: 201 from a run, not a replay, one effect.
func wantRetryRunsAgain(t *testing.T, e *env, h http.Handler, key string, fix func()) {
	t.Helper()
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys, want 0, 0", e.effects(), e.keys())
	}
	fix()
	r := do(h, key, body1)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("retry: %d %s, want 201 from a run", r.status, r.body)
	}
	if e.calls.Load() != 2 || e.effects() != 1 {
		t.Fatalf("retry: %d calls, %d effects, want 2, 1", e.calls.Load(), e.effects())
	}
}

type result struct {
	status int
	header http.Header
	body   []byte
}

func do(h http.Handler, key, body string, mods ...func(*http.Request)) result {
	return doCtx(context.Background(), h, key, body, mods...)
}

func doCtx(ctx context.Context, h http.Handler, key, body string, mods ...func(*http.Request)) result {
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/charges", strings.NewReader(body))
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	for _, m := range mods {
		m(r)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return result{status: w.Code, header: w.Result().Header, body: w.Body.Bytes()}
}

func wantProblem(t *testing.T, r result, status int) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d; body %s", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type = %q, want application/problem+json", ct)
	}
	var p struct {
		Status int    `json:"status"`
		Title  string `json:"title"`
	}
	if err := json.Unmarshal(r.body, &p); err != nil || p.Status != status || p.Title == "" {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
}

const body1 = `{"order":"o-1","amount":100}`

// 1 and 3: the claim, the call and the response commit together; a repeat
// replays status, allow-listed headers and the exact body, without a call.
func TestReplayIsByteIdentical(t *testing.T) {
	e := newEnv(t)
	// Set-Cookie is never stored, even when a service allow-lists it.
	e.cfg.ReplayHeaders = []string{"Location", "Set-Cookie"}
	h := e.handler(idem.Endpoint{})
	first := do(h, "k-1", body1)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	if first.header.Get("Idempotent-Replayed") != "" {
		t.Fatal("first response marked as replayed")
	}
	for i := 0; i < 3; i++ {
		again := do(h, "k-1", body1)
		if again.status != http.StatusCreated || !bytes.Equal(again.body, first.body) {
			t.Fatalf("replay %d: %d %s, want 201 %s", i, again.status, again.body, first.body)
		}
		if got := again.header.Get("Idempotent-Replayed"); got != "true" {
			t.Fatalf("Idempotent-Replayed = %q", got)
		}
		if again.header.Get("Location") != first.header.Get("Location") || again.header.Get("Location") == "" {
			t.Fatalf("Location %q, want %q", again.header.Get("Location"), first.header.Get("Location"))
		}
		if again.header.Get("Content-Type") != "application/json" {
			t.Fatalf("Content-Type %q", again.header.Get("Content-Type"))
		}
		if again.header.Get("Set-Cookie") != "" || again.header.Get("X-Not-Allowed") != "" {
			t.Fatalf("replayed a header off the allow-list: %v", again.header)
		}
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("function called %d times, want 1", n)
	}
	if n := e.effects(); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	// The key travels in the sf-string form of the IETF draft too.
	if r := do(h, `"k-1"`, body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("quoted key not recognised as the same key: %d", r.status)
	}
}

// 1 and 7: a function error rolls everything back, stores nothing, and the
// key is free: the retry runs the function and commits once.
func TestFunctionErrorStoresNothing(t *testing.T) {
	e := newEnv(t)
	var fail atomic.Bool
	fail.Store(true)
	e.hook = func(context.Context, pgx.Tx, chargeReq) error {
		if fail.Load() {
			return idem.Errorf(http.StatusPaymentRequired, "card declined")
		}
		return nil
	}
	h := e.handler(idem.Endpoint{})
	r := do(h, "k-err", body1)
	wantProblem(t, r, http.StatusPaymentRequired)
	if !strings.Contains(string(r.body), "card declined") {
		t.Fatalf("detail missing: %s", r.body)
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("after a failed call: %d effects, %d keys; want 0, 0", e.effects(), e.keys())
	}

	// A plain error is a 500 that leaks nothing.
	e.hook = func(context.Context, pgx.Tx, chargeReq) error { return errors.New("secret internal detail") }
	r = do(h, "k-err", body1)
	wantProblem(t, r, http.StatusInternalServerError)
	if strings.Contains(string(r.body), "secret") {
		t.Fatalf("500 leaked the error: %s", r.body)
	}

	e.hook = nil
	if r := do(h, "k-err", body1); r.status != http.StatusCreated {
		t.Fatalf("retry after failures: %d %s", r.status, r.body)
	}
	if e.effects() != 1 || e.keys() != 1 {
		t.Fatalf("after the retry: %d effects, %d keys; want 1, 1", e.effects(), e.keys())
	}
}

// 2: 64 concurrent requests with one key run the function once; with the
// default bounded wait every duplicate replays the winner's response.
func TestConcurrentSameKeyWaitsAndReplays(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	defer unblock() // on failure too, or the pool's cleanup waits forever
	e.hook = func(context.Context, pgx.Tx, chargeReq) error { <-release; return nil }
	h := e.handler(idem.Endpoint{Wait: 30 * time.Second})
	const n = 64
	results := make([]result, n)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() { defer wg.Done(); results[i] = do(h, "k-race", body1) }()
	}
	// Let the duplicates pile up behind the first claim, then let it finish.
	waitFor(t, func() bool { return e.calls.Load() == 1 })
	time.Sleep(200 * time.Millisecond)
	unblock()
	wg.Wait()

	replayed := 0
	for i, r := range results {
		if r.status != http.StatusCreated || !bytes.Equal(r.body, results[0].body) {
			t.Fatalf("request %d: %d %s; want 201 %s", i, r.status, r.body, results[0].body)
		}
		if r.header.Get("Idempotent-Replayed") == "true" {
			replayed++
		}
	}
	if replayed != n-1 {
		t.Fatalf("%d replays, want %d", replayed, n-1)
	}
	if c, ef := e.calls.Load(), e.effects(); c != 1 || ef != 1 {
		t.Fatalf("calls %d, effects %d; want 1, 1", c, ef)
	}
}

// 2: with Wait=NoWait (or a wait that runs out) a duplicate of an in-flight
// request gets 409 with Retry-After, and still nothing runs twice.
func TestConcurrentSameKeyConflict(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	defer close(release)  // on failure too, or the pool's cleanup waits forever
	var block atomic.Bool // only the first call of each subtest blocks
	e.hook = func(context.Context, pgx.Tx, chargeReq) error {
		if block.Swap(false) {
			<-release
		}
		return nil
	}
	for _, wait := range []time.Duration{0, 100 * time.Millisecond} {
		t.Run(wait.String(), func(t *testing.T) {
			h := e.handler(idem.Endpoint{Wait: wait, NoWait: wait == 0})
			key := "k-409-" + wait.String()
			firstDone := make(chan result, 1)
			before := e.calls.Load()
			block.Store(true)
			go func() { firstDone <- do(h, key, body1) }()
			waitFor(t, func() bool { return e.calls.Load() == before+1 })
			start := time.Now()
			dup := do(h, key, body1)
			wantProblem(t, dup, http.StatusConflict)
			if dup.header.Get("Retry-After") == "" {
				t.Fatal("409 without Retry-After")
			}
			if took := time.Since(start); took < wait {
				t.Fatalf("gave up after %v, before the %v wait", took, wait)
			}
			release <- struct{}{}
			if r := <-firstDone; r.status != http.StatusCreated {
				t.Fatalf("first: %d %s", r.status, r.body)
			}
			if r := do(h, key, body1); r.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("after the first finished: %d, not a replay", r.status)
			}
		})
	}
	if c := e.calls.Load(); c != 2 {
		t.Fatalf("calls %d, want 2 (one per key)", c)
	}
}

// 4: the same key with a different body or method is a 422.
func TestFingerprintMismatch(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{Route: "/charges"}) // any method
	if r := do(h, "k-fp", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d", r.status)
	}
	wantProblem(t, do(h, "k-fp", `{"order":"o-1","amount":101}`), http.StatusUnprocessableEntity)
	wantProblem(t, do(h, "k-fp", body1, func(r *http.Request) { r.Method = http.MethodPut }), http.StatusUnprocessableEntity)
	// A query parameter the function does not receive is not part of the
	// request (bind_test.go covers bound ones, which are).
	if r := do(h, "k-fp", body1, func(r *http.Request) { r.URL.RawQuery = "x=1" }); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("unbound query: %d %s, want a replay", r.status, r.body)
	}
	if e.calls.Load() != 1 || e.effects() != 1 {
		t.Fatalf("calls %d, effects %d", e.calls.Load(), e.effects())
	}
}

// 5: bad requests are rejected before any database work: nothing stored.
func TestBadRequestsStoreNothing(t *testing.T) {
	e := newEnv(t)
	e.cfg.MaxBodyBytes = 64
	h := e.handler(idem.Endpoint{})
	cases := []struct {
		name, key, body string
		mod             func(*http.Request)
		status          int
	}{
		{"missing key", "", body1, nil, http.StatusBadRequest},
		{"empty key", "", body1, func(r *http.Request) { r.Header.Set("Idempotency-Key", "") }, http.StatusBadRequest},
		{"empty quoted key", `""`, body1, nil, http.StatusBadRequest},
		{"key too long", strings.Repeat("k", 256), body1, nil, http.StatusBadRequest},
		{"control character", "k\x01x", body1, nil, http.StatusBadRequest},
		{"non-ASCII", "clé", body1, nil, http.StatusBadRequest},
		{"two keys", "k-a", body1, func(r *http.Request) { r.Header.Add("Idempotency-Key", "k-b") }, http.StatusBadRequest},
		{"body too large", "k-big", `{"order":"` + strings.Repeat("x", 100) + `","amount":1}`, nil, http.StatusRequestEntityTooLarge},
		{"invalid JSON", "k-json", `{"order":`, nil, http.StatusBadRequest},
		{"trailing data", "k-trail", body1 + `{}`, nil, http.StatusBadRequest},
		{"wrong JSON type", "k-type", `{"order":1}`, nil, http.StatusBadRequest},
		{"wrong method", "k-get", body1, func(r *http.Request) { r.Method = http.MethodGet }, http.StatusMethodNotAllowed},
	}
	for _, c := range cases {
		var mods []func(*http.Request)
		if c.mod != nil {
			mods = append(mods, c.mod)
		}
		t.Run(c.name, func(t *testing.T) { wantProblem(t, do(h, c.key, c.body, mods...), c.status) })
	}
	if e.calls.Load() != 0 || e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("calls %d, effects %d, keys %d; want all 0", e.calls.Load(), e.effects(), e.keys())
	}
	// A key of exactly the maximum length is fine.
	if r := do(h, strings.Repeat("k", idem.MaxKeyLength), body1); r.status != http.StatusCreated {
		t.Fatalf("255-byte key: %d %s", r.status, r.body)
	}
}

// An endpoint with key=optional runs a keyless request in a transaction,
// without storing anything; every keyless request runs.
func TestOptionalKey(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{KeyOptional: true})
	for i := 0; i < 2; i++ {
		if r := do(h, "", body1); r.status != http.StatusCreated {
			t.Fatalf("keyless %d: %d %s", i, r.status, r.body)
		}
	}
	if e.effects() != 2 || e.keys() != 0 {
		t.Fatalf("effects %d keys %d; want 2, 0", e.effects(), e.keys())
	}
}

// 6: keys are scoped per principal: the same key from two tenants is two
// operations, and neither can read the other's response.
func TestPrincipalScoping(t *testing.T) {
	e := newEnv(t)
	e.cfg.Principal = func(r *http.Request) (string, error) {
		p := r.Header.Get("X-Tenant")
		if p == "" {
			return "", errors.New("no tenant")
		}
		return p, nil
	}
	h := e.handler(idem.Endpoint{})
	tenant := func(name string) func(*http.Request) {
		return func(r *http.Request) { r.Header.Set("X-Tenant", name) }
	}
	a := do(h, "shared", `{"order":"a","amount":1}`, tenant("alice"))
	b := do(h, "shared", `{"order":"b","amount":2}`, tenant("bob"))
	if a.status != http.StatusCreated || b.status != http.StatusCreated || bytes.Equal(a.body, b.body) {
		t.Fatalf("alice %d %s, bob %d %s", a.status, a.body, b.status, b.body)
	}
	if r := do(h, "shared", `{"order":"a","amount":1}`, tenant("alice")); !bytes.Equal(r.body, a.body) {
		t.Fatalf("alice's replay %s, want %s", r.body, a.body)
	}
	// Bob sending Alice's exact request gets a 422, not her receipt.
	if r := do(h, "shared", `{"order":"a","amount":1}`, tenant("bob")); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("bob with alice's body: %d %s", r.status, r.body)
	}
	wantProblem(t, do(h, "shared", body1), http.StatusUnauthorized)
	if e.effects() != 2 {
		t.Fatalf("effects %d, want 2", e.effects())
	}
}

// 7: storage down fails closed: 503 with Retry-After, the function not called.
func TestStorageUnavailableFailsClosed(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var calls atomic.Int64
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		t.Fatal(err)
	}
	h := idem.Handle(engine, idem.Endpoint{Scope: "s"},
		func(context.Context, pgx.Tx, chargeReq) (receipt, error) { calls.Add(1); return receipt{}, nil })
	r := do(h, "k", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if r.header.Get("Retry-After") == "" || calls.Load() != 0 {
		t.Fatalf("Retry-After %q, calls %d", r.header.Get("Retry-After"), calls.Load())
	}
}

// The database connection dies in the middle of the function's transaction
// (a PostgreSQL restart, a network cut): nothing is stored, the client gets
// 503 with Retry-After (not a 500), and the retry runs the function once.
func TestConnectionKilledMidTransaction(t *testing.T) {
	e := newEnv(t)
	var kill atomic.Bool
	kill.Store(true)
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		if !kill.Load() {
			return nil
		}
		var pid int32
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		if _, err := e.pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
			return err
		}
		// The next statement on the dead connection fails.
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}
	h := e.handler(idem.Endpoint{})
	r := do(h, "k-kill", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if r.header.Get("Retry-After") == "" {
		t.Fatal("503 without Retry-After")
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("after the kill: effects %d, keys %d", e.effects(), e.keys())
	}
	kill.Store(false)
	if r := do(h, "k-kill", body1); r.status != http.StatusCreated {
		t.Fatalf("retry: %d %s", r.status, r.body)
	}
	if e.effects() != 1 || e.calls.Load() != 2 {
		t.Fatalf("effects %d calls %d; want 1, 2", e.effects(), e.calls.Load())
	}
}

// 8: a key expires after its TTL; an expired key is new again, and retention
// deletes expired rows in bounded batches.
func TestExpiry(t *testing.T) {
	e := newEnv(t)
	h := e.handler(idem.Endpoint{TTL: time.Hour})
	for i := 0; i < 25; i++ {
		if r := do(h, fmt.Sprintf("k-%d", i), body1); r.status != http.StatusCreated {
			t.Fatal(r.status)
		}
	}
	if r := do(h, "k-0", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatal("live key not replayed")
	}
	// Age every key past its TTL.
	pgtest.Exec(t, e.pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second'`)
	first := do(h, "k-0", `{"order":"o-1","amount":555}`) // even a new body: the old key is gone
	if first.status != http.StatusCreated || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("expired key: %d replayed=%q", first.status, first.header.Get("Idempotent-Replayed"))
	}
	if r := do(h, "k-0", `{"order":"o-1","amount":555}`); !bytes.Equal(r.body, first.body) {
		t.Fatal("taken-over key not replayed")
	}

	store := idem.NewStore(e.pool)
	n, err := store.DeleteExpiredKeys(context.Background(), 10)
	if err != nil || n != 10 {
		t.Fatalf("one batch deleted %d (%v), want 10", n, err)
	}
	total, err := store.PurgeExpiredKeys(context.Background(), 10)
	if err != nil || total != 14 {
		t.Fatalf("purge deleted %d (%v), want the other 14", total, err)
	}
	if e.keys() != 1 {
		t.Fatalf("%d keys left, want the 1 live one", e.keys())
	}
	if _, err := store.DeleteExpiredKeys(context.Background(), 0); err == nil {
		t.Fatal("batch size 0 accepted")
	}
}

// 9: the function sees its key, and Derive gives downstream calls a key
// that is stable across retries and distinct per name and per key.
func TestKeyInContext(t *testing.T) {
	e := newEnv(t)
	var seen []idem.Key
	var mu sync.Mutex
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		k, ok := idem.KeyFromContext(ctx)
		if !ok {
			return errors.New("no key in context")
		}
		mu.Lock()
		seen = append(seen, k)
		mu.Unlock()
		return errors.New("fail so the retry calls again")
	}
	h := e.handler(idem.Endpoint{Scope: "scope-x"})
	do(h, "k-ctx", body1)
	do(h, "k-ctx", body1)
	if len(seen) != 2 || seen[0] != (idem.Key{Scope: "scope-x", Key: "k-ctx"}) || seen[0] != seen[1] {
		t.Fatalf("keys seen: %+v", seen)
	}
	k := seen[0]
	if k.Derive("psp") != seen[1].Derive("psp") || k.Derive("psp") == k.Derive("mail") ||
		k.Derive("psp") == (idem.Key{Scope: "scope-x", Key: "k-ctx2"}).Derive("psp") {
		t.Fatal("Derive is not stable and distinct")
	}
	if _, ok := idem.KeyFromContext(context.Background()); ok {
		t.Fatal("key outside a wrapped function")
	}
}

// 10: the client goes away (or shutdown cancels the request) while the
// function runs: the transaction rolls back and nothing is stored, even if the
// function ignores the cancellation and returns success.
func TestCancellationRollsBack(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	var swallow atomic.Bool
	e.hook = func(hctx context.Context, _ pgx.Tx, _ chargeReq) error {
		cancel()
		<-hctx.Done()
		if swallow.Load() {
			return nil // a function that swallows cancellation
		}
		return hctx.Err()
	}
	h := e.handler(idem.Endpoint{})
	r := doCtx(ctx, h, "k-cancel", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)

	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	swallow.Store(true)
	r = doCtx(ctx, h, "k-cancel", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("after cancellation: effects %d, keys %d", e.effects(), e.keys())
	}
	e.hook = nil
	if r := do(h, "k-cancel", body1); r.status != http.StatusCreated || e.effects() != 1 {
		t.Fatalf("retry: %d, effects %d", r.status, e.effects())
	}
}

// The handler's own statements do not inherit the claim's lock_timeout.
func TestLockTimeoutDoesNotLeak(t *testing.T) {
	e := newEnv(t)
	var got string
	e.hook = func(ctx context.Context, tx pgx.Tx, _ chargeReq) error {
		return tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got)
	}
	var want string
	if err := e.pool.QueryRow(context.Background(), `SHOW lock_timeout`).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if r := do(e.handler(idem.Endpoint{Wait: 1234 * time.Millisecond}), "k-lt", body1); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	if got != want {
		t.Fatalf("lock_timeout inside the function = %q, want the session's %q", got, want)
	}
}

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- idem.Migrate(context.Background(), pool) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if !strings.Contains(idem.Schema(), "CREATE TABLE IF NOT EXISTS idem_keys") {
		t.Fatal("Schema() does not hold the DDL")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
