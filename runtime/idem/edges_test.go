package idem_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
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

// The tests of this file go through real HTTP (httptest.Server and
// net/http's client) to real PostgreSQL.

// serveReal serves h on a loopback port for the test's duration.
func serveReal(t *testing.T, h http.Handler) string {
	t.Helper()
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s.URL
}

var httpClient = &http.Client{Timeout: 20 * time.Second}

// send POSTs body to url with key ("" for none) and header pairs.
func send(t *testing.T, url, key, body string, header ...string) result {
	t.Helper()
	return sendMethod(t, http.MethodPost, url, key, body, header...)
}

func sendMethod(t *testing.T, method, url, key, body string, header ...string) result {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", method, url, err)
		return result{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, header: resp.Header, body: b}
}

// Issue 9.1: Principal runs for every request. A key=optional endpoint
// authenticates a keyless request exactly as one with a key, and the
// function sees the principal either way.
func TestPrincipalRunsWithoutKey(t *testing.T) {
	e := newEnv(t)
	e.cfg.Principal = func(r *http.Request) (string, error) {
		if p := r.Header.Get("X-Tenant"); p != "" {
			return p, nil
		}
		return "", errors.New("no tenant")
	}
	var seen sync.Map
	e.hook = func(ctx context.Context, _ pgx.Tx, req chargeReq) error {
		p, ok := idem.PrincipalFromContext(ctx)
		if !ok {
			return errors.New("no principal in context")
		}
		seen.Store(req.Order, p)
		return nil
	}
	url := serveReal(t, e.handler(idem.Endpoint{KeyOptional: true})) + "/charges"
	wantProblem(t, send(t, url, "", body1), http.StatusUnauthorized)
	wantProblem(t, send(t, url, "k-1", body1), http.StatusUnauthorized)
	if e.calls.Load() != 0 {
		t.Fatalf("function ran %d times for unauthenticated requests", e.calls.Load())
	}
	if r := send(t, url, "", `{"order":"keyless","amount":1}`, "X-Tenant", "alice"); r.status != http.StatusCreated {
		t.Fatalf("keyless, authenticated: %d %s", r.status, r.body)
	}
	if r := send(t, url, "k-2", `{"order":"keyed","amount":1}`, "X-Tenant", "bob"); r.status != http.StatusCreated {
		t.Fatalf("keyed, authenticated: %d %s", r.status, r.body)
	}
	for order, want := range map[string]string{"keyless": "alice", "keyed": "bob"} {
		if p, _ := seen.Load(order); p != want {
			t.Fatalf("%s request: principal in context %v, want %q", order, p, want)
		}
	}
}

// Issue 9.2: the RFC 8941 sf-string form of a key is decoded, so bare
// q"x-R and quoted "q\"x-R" are one key; malformed quoting is a 400.
func TestQuotedKeyDecoding(t *testing.T) {
	e := newEnv(t)
	url := serveReal(t, e.handler(idem.Endpoint{})) + "/charges"
	first := send(t, url, `q"x-R`, body1)
	if first.status != http.StatusCreated {
		t.Fatalf("bare key: %d %s", first.status, first.body)
	}
	for _, quoted := range []string{`"q\"x-R"`} {
		r := send(t, url, quoted, body1)
		if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(r.body, first.body) {
			t.Fatalf("%s: %d replayed=%q, want the replay of the bare key", quoted, r.status, r.header.Get("Idempotent-Replayed"))
		}
	}
	if r := send(t, url, `"back\\slash"`, body1); r.status != http.StatusCreated {
		t.Fatalf(`escaped backslash: %d %s`, r.status, r.body)
	}
	if r := send(t, url, `back\slash`, body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf(`bare back\slash is not the key "back\\slash": %d`, r.status)
	}
	for _, bad := range []string{`"abc`, `"a\b"`, `"abc"x`, `"a"b"`, `"\"`, `"a b"`} {
		wantProblem(t, send(t, url, bad, body1), http.StatusBadRequest)
	}
	if e.effects() != 2 {
		t.Fatalf("%d effects, want 2 (one per distinct key)", e.effects())
	}
}

// Issue 9.3: a principal too long for the index, or holding a NUL, is
// stored in hashed form: 201 and replays, never a retry-forever 503. A
// principal that spells another's hashed form is still another principal.
func TestLongAndUnstorablePrincipals(t *testing.T) {
	e := newEnv(t)
	long := strings.Repeat("tenant-", 1000) // 7 KB: over btree's ~2.7 KB row limit
	hashed := sha256.Sum256([]byte(long))
	impostor := "idem-sha256:" + hex.EncodeToString(hashed[:])
	e.cfg.Principal = func(r *http.Request) (string, error) {
		switch r.Header.Get("X-Who") {
		case "long":
			return long, nil
		case "nul":
			return "ten\x00ant", nil
		case "invalid-utf8":
			return "ten\xffant", nil
		default:
			return impostor, nil
		}
	}
	url := serveReal(t, e.handler(idem.Endpoint{})) + "/charges"
	for _, who := range []string{"long", "nul", "invalid-utf8", "impostor"} {
		first := send(t, url, "k-p", body1, "X-Who", who)
		if first.status != http.StatusCreated {
			t.Fatalf("%s principal: %d %s", who, first.status, first.body)
		}
		again := send(t, url, "k-p", body1, "X-Who", who)
		if again.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again.body, first.body) {
			t.Fatalf("%s principal: not replayed: %d", who, again.status)
		}
	}
	if e.effects() != 4 {
		t.Fatalf("%d effects, want 4: each principal is its own, the impostor too", e.effects())
	}
}

// lockTable holds lock on table in a transaction of its own until the test
// ends (or release is called).
func lockTable(t *testing.T, pool *pgxpool.Pool, sql string) (release func()) {
	t.Helper()
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), sql); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	t.Cleanup(release)
	return release
}

// Issue 9.4: a lock wait that is not the same key in flight (a table lock
// by a migration, a purge holding an expired row) is a 503 with
// Retry-After, not a 409 "still being processed".
func TestOnlySameKeyInFlightIs409(t *testing.T) {
	e := newEnv(t)
	url := serveReal(t, e.handler(idem.Endpoint{Wait: 300 * time.Millisecond})) + "/charges"
	if r := send(t, url, "k-expired", body1); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	pgtest.Exec(t, e.pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second'`)

	t.Run("table lock", func(t *testing.T) {
		release := lockTable(t, e.pool, `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`)
		defer release()
		r := send(t, url, "k-never-sent", body1)
		wantProblem(t, r, http.StatusServiceUnavailable)
		if r.header.Get("Retry-After") == "" {
			t.Fatal("503 without Retry-After")
		}
	})
	t.Run("expired row locked by a purge", func(t *testing.T) {
		release := lockTable(t, e.pool, `SELECT 1 FROM idem_keys WHERE key = 'k-expired' FOR UPDATE`)
		defer release()
		r := send(t, url, "k-expired", body1)
		wantProblem(t, r, http.StatusServiceUnavailable)
		if r.header.Get("Retry-After") == "" {
			t.Fatal("503 without Retry-After")
		}
	})
	if e.calls.Load() != 1 {
		t.Fatalf("calls %d, want 1", e.calls.Load())
	}
	// Unlocked, both run.
	for _, k := range []string{"k-never-sent", "k-expired"} {
		if r := send(t, url, k, body1); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("%s after the locks: %d", k, r.status)
		}
	}
}

// Issue 9.5: the wait for a pool connection is bounded by wait too: with
// every connection taken, the answer is a 503 with Retry-After after about
// wait, not a response that waits as long as the pool does.
func TestWaitBoundsPoolAcquire(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	url := serveReal(t, idem.Handle(engine, idem.Endpoint{Scope: "s", Wait: 300 * time.Millisecond},
		func(context.Context, pgx.Tx, chargeReq) (receipt, error) { calls.Add(1); return receipt{}, nil }))
	held, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r := send(t, url, "k-pool", body1)
	held.Release()
	wantProblem(t, r, http.StatusServiceUnavailable)
	if r.header.Get("Retry-After") == "" || calls.Load() != 0 {
		t.Fatalf("Retry-After %q, calls %d", r.header.Get("Retry-After"), calls.Load())
	}
	if r := send(t, url, "k-pool", body1); r.status != http.StatusOK {
		t.Fatalf("with the connection free: %d %s", r.status, r.body)
	}
}

// Issue 9.5: duplicates of a key in flight hold no pooled connection while
// they wait. With a pool of 3 and 20 duplicates waiting on one key, the
// pool stays free for other keys, and every duplicate replays at the end.
func TestDuplicatesHoldNoConnection(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 3 })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	var calls atomic.Int64
	fn := func(_ context.Context, _ pgx.Tx, req chargeReq) (receipt, error) {
		calls.Add(1)
		if req.Order == "slow" {
			<-release
		}
		return receipt{Order: req.Order}, nil
	}
	var arrived atomic.Int64
	h := idem.Handle(engine, idem.Endpoint{Scope: "s", Wait: 20 * time.Second}, fn)
	url := serveReal(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(unblock) // before the server closes (cleanups run last first)

	slow := `{"order":"slow","amount":1}`
	const n = 20
	results := make([]result, n+1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); results[0] = send(t, url, "k-storm", slow) }()
	waitFor(t, func() bool { return calls.Load() == 1 })
	for i := 1; i <= n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); results[i] = send(t, url, "k-storm", slow) }()
	}
	waitFor(t, func() bool { return arrived.Load() == n+1 })
	time.Sleep(100 * time.Millisecond) // let any duplicate that would take a connection take it
	if got := pool.Stat().AcquiredConns(); got != 1 {
		t.Fatalf("%d connections acquired while %d duplicates wait, want 1 (the first request's)", got, n)
	}
	// Nor do they take one now and then: waiting duplicates of a key in
	// flight in this process do not poll the database (they wait for the
	// key's turn), so no acquire happens while they wait.
	acquires := pool.Stat().AcquireCount()
	time.Sleep(300 * time.Millisecond)
	if got := pool.Stat().AcquireCount() - acquires; got != 0 {
		t.Fatalf("%d acquires in 300ms while %d duplicates wait, want 0", got, n)
	}
	// Other keys are served meanwhile, from the same pool.
	for i := 0; i < 5; i++ {
		if r := send(t, url, "k-other-"+string(rune('a'+i)), body1); r.status != http.StatusOK {
			t.Fatalf("another key during the storm: %d %s", r.status, r.body)
		}
	}
	unblock()
	wg.Wait()
	for i, r := range results {
		if r.status != http.StatusOK || !bytes.Equal(r.body, results[0].body) {
			t.Fatalf("request %d: %d %s, want 200 %s", i, r.status, r.body, results[0].body)
		}
		if replayed := r.header.Get("Idempotent-Replayed") == "true"; replayed != (i > 0) {
			t.Fatalf("request %d: replayed=%v", i, replayed)
		}
	}
	if calls.Load() != 1+5 {
		t.Fatalf("calls %d, want 6", calls.Load())
	}
}

// Issue 9.5: a duplicate on another replica (another engine and pool) waits
// for the key by polling, holding at most one connection at a time however
// many duplicates it has, and replays once the first finishes; if the first
// does not finish within wait, it is a 409.
func TestDuplicateOnAnotherReplica(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	newReplica := func() (*pgxpool.Pool, *idem.HTTP) {
		pool, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		if err := idem.Migrate(context.Background(), pool); err != nil {
			t.Fatal(err)
		}
		engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
		if err != nil {
			t.Fatal(err)
		}
		return pool, engine
	}
	_, a := newReplica()
	poolB, b := newReplica()
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	var calls atomic.Int64
	fn := func(context.Context, pgx.Tx, chargeReq) (receipt, error) {
		if calls.Add(1) == 1 {
			<-release
		}
		return receipt{ID: calls.Load()}, nil
	}
	urlA := serveReal(t, idem.Handle(a, idem.Endpoint{Scope: "s"}, fn))
	urlB := serveReal(t, idem.Handle(b, idem.Endpoint{Scope: "s", Wait: 10 * time.Second}, fn))
	shortB := serveReal(t, idem.Handle(b, idem.Endpoint{Scope: "s", Wait: 200 * time.Millisecond}, fn))
	t.Cleanup(unblock)

	first := make(chan result, 1)
	go func() { first <- send(t, urlA, "k-x", body1) }()
	waitFor(t, func() bool { return calls.Load() == 1 })

	wantProblem(t, send(t, shortB, "k-x", body1), http.StatusConflict)

	const n = 5
	dups := make([]result, n)
	var wg sync.WaitGroup
	for i := range dups {
		wg.Add(1)
		go func() { defer wg.Done(); dups[i] = send(t, urlB, "k-x", body1) }()
	}
	var most int32
	for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		most = max(most, poolB.Stat().AcquiredConns())
	}
	unblock()
	wg.Wait()
	firstR := <-first
	if firstR.status != http.StatusOK {
		t.Fatalf("first: %d %s", firstR.status, firstR.body)
	}
	for i, r := range dups {
		if r.status != http.StatusOK || r.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(r.body, firstR.body) {
			t.Fatalf("duplicate %d on replica B: %d %s", i, r.status, r.body)
		}
	}
	if most > 1 {
		t.Fatalf("replica B held %d connections at once for %d waiting duplicates, want at most 1", most, n)
	}
	if calls.Load() != 1 {
		t.Fatalf("calls %d, want 1", calls.Load())
	}
}

// Issue 9.6: a value PostgreSQL refuses to store (a NUL in text, an index
// row too large, text that is not a number) is the client's mistake: 422
// problem+json, nothing stored, and the key free for a corrected request.
func TestUnstorableValuesAre422(t *testing.T) {
	e := newEnv(t)
	pgtest.Exec(t, e.pool, `CREATE INDEX effects_order ON effects (order_id)`)
	e.hook = func(ctx context.Context, tx pgx.Tx, req chargeReq) error {
		if strings.HasPrefix(req.Order, "n:") {
			var n int
			return tx.QueryRow(ctx, `SELECT $1::text::int`, strings.TrimPrefix(req.Order, "n:")).Scan(&n)
		}
		return nil
	}
	url := serveReal(t, e.handler(idem.Endpoint{})) + "/charges"
	cases := map[string]string{
		"NUL":          `{"order":"o\u0000x","amount":1}`,
		"index row":    `{"order":"` + incompressible(20000) + `","amount":1}`,
		"not a number": `{"order":"n:abc","amount":1}`,
	}
	for name, body := range cases {
		r := send(t, url, "k-"+strings.ReplaceAll(name, " ", "-"), body)
		wantProblem(t, r, http.StatusUnprocessableEntity)
		if !strings.Contains(string(r.body), "cannot store") {
			t.Fatalf("%s: detail %s", name, r.body)
		}
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("effects %d, keys %d; want 0, 0", e.effects(), e.keys())
	}
	if r := send(t, url, "k-NUL", body1); r.status != http.StatusCreated {
		t.Fatalf("the corrected request: %d %s", r.status, r.body)
	}
}

// incompressible returns n hex digits of random bytes: text that TOAST
// compression cannot shrink below the btree row limit.
func incompressible(n int) string {
	b := make([]byte, n/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Issue 9.7: a wrong method on a route registered with HandleRoute (as
// generated RegisterIdemRoutes do) is a 405 problem+json whose Allow lists
// every method served for the path, the service's own routes included.
func TestHandleRoute405IsProblemJSON(t *testing.T) {
	e := newEnv(t)
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /charges", e.handler(idem.Endpoint{Route: "POST /charges"}))
	idem.HandleRoute(mux, "PUT /charges", e.handler(idem.Endpoint{Route: "PUT /charges", Scope: "put"}))
	idem.HandleRoute(mux, "POST /charges/{id}", e.handler(idem.Endpoint{Route: "POST /charges/{id}", Scope: "id"}))
	idem.HandleRoute(mux, "DELETE /charges/{name}", e.handler(idem.Endpoint{Route: "DELETE /charges/{name}", Scope: "del"}))
	mux.HandleFunc("GET /charges", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("list")) })
	url := serveReal(t, mux)

	r := sendMethod(t, http.MethodPatch, url+"/charges", "k", body1)
	wantProblem(t, r, http.StatusMethodNotAllowed)
	if got := r.header.Get("Allow"); got != "GET, HEAD, POST, PUT" {
		t.Fatalf("Allow = %q, want GET, HEAD, POST, PUT", got)
	}
	r = sendMethod(t, http.MethodGet, url+"/charges/7", "k", "")
	wantProblem(t, r, http.StatusMethodNotAllowed)
	if got := r.header.Get("Allow"); got != "POST, DELETE" {
		t.Fatalf("Allow = %q, want POST, DELETE", got)
	}
	if r := sendMethod(t, http.MethodGet, url+"/charges", "", ""); r.status != http.StatusOK || string(r.body) != "list" {
		t.Fatalf("the service's own GET: %d %s", r.status, r.body)
	}
	if r := send(t, url+"/charges", "k-ok", body1); r.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", r.status, r.body)
	}
}

// Issue 9.8: a body in another media type is a 415; JSON media types (with
// parameters, +json suffixes) and a body without Content-Type are decoded.
// Unknown fields are ignored by default and a 400 with
// DisallowUnknownFields.
func TestContentTypeAndStrictDecoding(t *testing.T) {
	e := newEnv(t)
	url := serveReal(t, e.handler(idem.Endpoint{})) + "/charges"
	for _, ct := range []string{"text/plain", "application/x-www-form-urlencoded", "not a media type;;"} {
		wantProblem(t, send(t, url, "k-415", body1, "Content-Type", ct), http.StatusUnsupportedMediaType)
	}
	for i, ct := range []string{"application/json; charset=utf-8", "application/merge-patch+json", ""} {
		if r := send(t, url, "k-json-"+string(rune('a'+i)), body1, "Content-Type", ct); r.status != http.StatusCreated {
			t.Fatalf("Content-Type %q: %d %s", ct, r.status, r.body)
		}
	}
	unknown := `{"order":"o-1","amount":1,"amonut":2}`
	if r := send(t, url, "k-unknown", unknown); r.status != http.StatusCreated {
		t.Fatalf("unknown field, default: %d %s", r.status, r.body)
	}
	e.cfg.DisallowUnknownFields = true
	strict := serveReal(t, e.handler(idem.Endpoint{Scope: "strict"})) + "/charges"
	wantProblem(t, send(t, strict, "k-strict", unknown), http.StatusBadRequest)
	if r := send(t, strict, "k-strict", body1); r.status != http.StatusCreated {
		t.Fatalf("known fields, strict: %d %s", r.status, r.body)
	}
}

// Issue 10: NewHTTP validates its configuration; zero values are the
// defaults and "none" is explicit.
func TestNewHTTPValidates(t *testing.T) {
	store := idem.NewStore(nil)
	for name, cfg := range map[string]idem.HTTPConfig{
		"negative body limit": {MaxBodyBytes: -1},
		"none and a list":     {NoReplayHeaders: true, ReplayHeaders: []string{"Location"}},
		"negative conn check": {ConnCheckInterval: -time.Second},
		"read-only tx":        {TxOptions: pgx.TxOptions{AccessMode: pgx.ReadOnly}},
		"idle over max":       {IdleInTransactionTimeout: 30 * 24 * time.Hour},
		"conn check over max": {ConnCheckInterval: 30 * 24 * time.Hour},
	} {
		if _, err := idem.NewHTTP(store, cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := idem.NewHTTP(nil, idem.HTTPConfig{}); err == nil {
		t.Error("nil store accepted")
	}
	for name, ep := range map[string]idem.Endpoint{
		"negative wait": {Wait: -1},
		"status 500":    {Status: 500},
		"negative TTL":  {TTL: -time.Hour},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Handle accepted an endpoint with %s", name)
				}
			}()
			h, _ := idem.NewHTTP(store, idem.HTTPConfig{})
			idem.Handle(h, ep, func(context.Context, pgx.Tx, chargeReq) (receipt, error) { return receipt{}, nil })
		}()
	}
}

// Issue 10: ReplayHeaders empty means the default (Location);
// NoReplayHeaders stores none but Content-Type.
func TestReplayHeadersDefaultAndNone(t *testing.T) {
	e := newEnv(t)
	e.cfg.ReplayHeaders = []string{}
	def := serveReal(t, e.handler(idem.Endpoint{Scope: "default"})) + "/charges"
	e.cfg = idem.HTTPConfig{NoReplayHeaders: true}
	none := serveReal(t, e.handler(idem.Endpoint{Scope: "none"})) + "/charges"
	for url, wantLocation := range map[string]bool{def: true, none: false} {
		send(t, url, "k-h", body1)
		r := send(t, url, "k-h", body1)
		if r.header.Get("Idempotent-Replayed") != "true" || (r.header.Get("Location") != "") != wantLocation ||
			r.header.Get("Content-Type") != "application/json" {
			t.Fatalf("replay: Location %q (want it: %v), Content-Type %q", r.header.Get("Location"), wantLocation, r.header.Get("Content-Type"))
		}
	}
}

// Issue 9.4: with NoWait, concurrent replays of a completed key are
// replays, not 409s: only a key really in flight is a conflict. This guards
// the per-key turn of this process (a NoWait request that finds the turn
// taken must ask the database, not assume the key is in flight).
func TestNoWaitConcurrentReplaysAreNot409(t *testing.T) {
	e := newEnv(t)
	url := serveReal(t, e.handler(idem.Endpoint{NoWait: true})) + "/charges"
	first := send(t, url, "k-hot", body1)
	if first.status != http.StatusCreated {
		t.Fatal(first.status)
	}
	const n = 32
	results := make([]result, n)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() { defer wg.Done(); results[i] = send(t, url, "k-hot", body1) }()
	}
	wg.Wait()
	for i, r := range results {
		if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(r.body, first.body) {
			t.Fatalf("replay %d: %d %s", i, r.status, r.body)
		}
	}
}

// Issue 11: the takeover of an expired row locks it in a round trip of its
// own after the claim's; a broken connection there is the claim's broken
// connection: nothing has committed, so the claim is begun again on another
// connection, within the wait, and the function runs once. Here the session
// waiting for the row (held by a purge) is terminated; the claim retried
// waits for the row again and takes it over once the purge is gone.
func TestTakeoverLockConnectionLostIsRetried(t *testing.T) {
	app := "idem-takeover-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	e := newEnvPool(t, pool)
	h := e.handler(idem.Endpoint{Wait: 10 * time.Second})
	if r := do(h, "k-takeover", body1); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	pgtest.Exec(t, pool, `UPDATE idem_keys SET expires_at = now() - interval '1 second'`)
	admin := pgtest.Pool(t)
	release := lockTable(t, pool, `SELECT 1 FROM idem_keys WHERE key = 'k-takeover' FOR UPDATE`)
	done := make(chan result, 1)
	go func() { done <- do(h, "k-takeover", body1) }()
	// waiting is the backend of this test's pool waiting for the row lock
	// in LockExpiredKey.
	waiting := func() (pid int32) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			err := admin.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity
				WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE '%name: LockExpiredKey%'`, app).Scan(&pid)
			if err == nil {
				return pid
			}
			if !errors.Is(err, pgx.ErrNoRows) {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatal("no takeover waiting for the expired row")
		return 0
	}
	first := waiting()
	if _, err := admin.Exec(context.Background(), `SELECT pg_terminate_backend($1, 5000)`, first); err != nil {
		t.Fatal(err)
	}
	if again := waiting(); again == first {
		t.Fatalf("backend %d still waiting after its termination", first)
	}
	release()
	r := <-done
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("takeover after a lost connection: %d %s, want the function's 201", r.status, r.body)
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("function ran %d times, want 2 (the first request and the takeover)", n)
	}
	if r := do(h, "k-takeover", body1); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after the takeover: %d %s, want a replay", r.status, r.body)
	}
}
