package idem_test

// revprob: an outsider's attack on problemFor's context cases and begin's
// busy/storage split, over a real network (an http.Client against an
// httptest.Server, or idem.ServeHTTP) on real PostgreSQL. Each scenario
// checks what the server answered (recorded on the server side, since the
// client may be gone), its problem+json form and README wording, and that
// the key is consistent afterwards: a retry with the same key runs the
// function exactly once overall, or replays what committed.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
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

// rpAnswer is what the handler wrote, as recorded on the server.
type rpAnswer struct {
	status int
	header http.Header
	body   []byte
}

type rpRecorder struct {
	http.ResponseWriter
	status int
	body   bytes.Buffer
}

func (r *rpRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *rpRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	r.body.Write(b)
	return r.ResponseWriter.Write(b)
}

// rpTap wraps h: every answer it writes is sent on the channel.
func rpTap(h http.Handler) (http.Handler, <-chan rpAnswer) {
	ch := make(chan rpAnswer, 16)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &rpRecorder{ResponseWriter: w}
		h.ServeHTTP(rec, r)
		ch <- rpAnswer{status: rec.status, header: w.Header().Clone(), body: rec.body.Bytes()}
	}), ch
}

// rpServer serves h on a real listener; it returns the URL and the
// server-side answers.
func rpServer(t *testing.T, h http.Handler) (string, <-chan rpAnswer) {
	t.Helper()
	tapped, ch := rpTap(h)
	s := httptest.NewServer(tapped)
	t.Cleanup(s.Close)
	return s.URL + "/charges", ch
}

// rpPost sends one request with its own transport (a real TCP connection);
// it returns the client's view (nil on a client-side error).
func rpPost(ctx context.Context, url, key, body string) (*rpAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return &rpAnswer{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

func rpMustPost(t *testing.T, url, key, body string) *rpAnswer {
	t.Helper()
	a, err := rpPost(context.Background(), url, key, body)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	return a
}

// rpAsk posts key with body1; it returns the server's answer and how long
// the client waited for its own.
func rpAsk(t *testing.T, url, key string, answers <-chan rpAnswer) (rpAnswer, time.Duration) {
	t.Helper()
	start := time.Now()
	rpMustPost(t, url, key, body1)
	took := time.Since(start)
	return rpNext(t, answers), took
}

// rpPostGone posts key with body1 from a client that goes away 300ms after
// leave is ready (nil: 300ms in); the client must see its request fail.
func rpPostGone(t *testing.T, url, key string, leave <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		if leave != nil {
			<-leave
		}
		time.Sleep(300 * time.Millisecond)
		cancel()
	}()
	if _, err := rpPost(ctx, url, key, body1); err == nil {
		t.Fatal("client: no error after cancelling")
	}
}

// rpSlowCommit makes the COMMIT of a charge of 100 take a second (a
// deferred trigger sleeping) and sets e's hook; the channel is ready once
// the function has returned, its COMMIT about to run.
func rpSlowCommit(t *testing.T, e *env) <-chan struct{} {
	t.Helper()
	pgtest.Exec(t, e.pool, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW WHEN (NEW.amount = 100) EXECUTE FUNCTION slow_commit()`)
	returned := make(chan struct{}, 1)
	e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
		select {
		case returned <- struct{}{}:
		default:
		}
		return nil
	}
	return returned
}

// rpWantNothingStored checks that no effect and no key were stored.
func rpWantNothingStored(t *testing.T, e *env) {
	t.Helper()
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys", e.effects(), e.keys())
	}
}

// rpNext is the server's next answer.
func rpNext(t *testing.T, ch <-chan rpAnswer) rpAnswer {
	t.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(30 * time.Second):
		t.Fatal("no answer from the handler within 30s")
		return rpAnswer{}
	}
}

type rpProblem struct {
	Type, Title, Detail string
	Status              int
}

// rpWant checks a's problem+json: status, title and a part of the detail
// (either may be ""), Retry-After present or not.
func rpWant(t *testing.T, what string, a rpAnswer, status int, title, detail string, retryAfter bool) {
	t.Helper()
	var p rpProblem
	if err := json.Unmarshal(a.body, &p); err != nil {
		t.Fatalf("%s: %d %s: not JSON: %v", what, a.status, a.body, err)
	}
	ct := a.header.Get("Content-Type")
	if a.status != status || p.Status != status || ct != "application/problem+json" ||
		(title != "" && p.Title != title) || !strings.Contains(p.Detail, detail) ||
		(a.header.Get("Retry-After") != "") != retryAfter {
		t.Fatalf("%s: %d %s (Content-Type %q, Retry-After %q); want %d title %q detail ~%q Retry-After %v",
			what, a.status, a.body, ct, a.header.Get("Retry-After"), status, title, detail, retryAfter)
	}
}

// rpRetryRunsOnce checks the retry with key: 201; replayed iff committed
// (effects before the retry); exactly one effect and one key after.
func rpRetryRunsOnce(t *testing.T, e *env, url, key string) {
	t.Helper()
	committed := e.effects()
	if committed > 1 || e.keys() != committed {
		t.Fatalf("before the retry: %d effects, %d keys", committed, e.keys())
	}
	calls := e.calls.Load()
	a := rpMustPost(t, url, key, body1)
	replayed := a.header.Get("Idempotent-Replayed") == "true"
	if a.status != http.StatusCreated || replayed != (committed == 1) {
		t.Fatalf("retry with %d committed: %d %s replayed=%v", committed, a.status, a.body, replayed)
	}
	if e.effects() != 1 || e.keys() != 1 || e.calls.Load() != calls+1-committed {
		t.Fatalf("after the retry: %d effects, %d keys, %d calls (before %d); want 1, 1, one more call iff nothing committed",
			e.effects(), e.keys(), e.calls.Load(), calls)
	}
	// And again: a replay, byte-identical, never a run.
	b := rpMustPost(t, url, key, body1)
	if b.status != http.StatusCreated || b.header.Get("Idempotent-Replayed") != "true" || (!replayed && !bytes.Equal(a.body, b.body)) {
		t.Fatalf("second retry: %d %s (replayed %q), first %s", b.status, b.body, b.header.Get("Idempotent-Replayed"), a.body)
	}
}

// rpWaitFor polls cond (bounded).
func rpWaitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A client that disconnects at each point before the COMMIT: the answer
// (heard by nobody) is the cancellation's 503 without Retry-After, nothing
// is logged as a failure, nothing is stored, and the retry runs once.
func TestRevprobClientGoneBeforeCommit(t *testing.T) {
	t.Run("waiting for a pool connection", func(t *testing.T) {
		pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 2 })
		e := newEnvPool(t, pool)
		logs := e.captureLogs()
		url, answers := rpServer(t, e.handler(idem.Endpoint{Wait: 10 * time.Second}))
		c1, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		c2, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		rpPostGone(t, url, "k-pool", nil)
		a := rpNext(t, answers)
		c1.Release()
		c2.Release()
		rpWant(t, "gone waiting for the pool", a, http.StatusServiceUnavailable, "", "request cancelled; nothing was done", false)
		if e.calls.Load() != 0 || logs.String() != "" {
			t.Fatalf("%d calls, log %q", e.calls.Load(), logs)
		}
		rpRetryRunsOnce(t, e, url, "k-pool")
	})
	t.Run("waiting for a duplicate in flight", func(t *testing.T) {
		e := newEnv(t)
		release := make(chan struct{})
		var first atomic.Bool
		e.hook = func(ctx context.Context, _ pgx.Tx, _ chargeReq) error {
			if first.CompareAndSwap(false, true) {
				<-release
			}
			return nil
		}
		url, answers := rpServer(t, e.handler(idem.Endpoint{Wait: 10 * time.Second}))
		done := make(chan *rpAnswer, 1)
		go func() { a, _ := rpPost(context.Background(), url, "k-dup", body1); done <- a }()
		rpWaitFor(t, "the first request in the function", func() bool { return e.calls.Load() == 1 })
		rpPostGone(t, url, "k-dup", nil)
		a := rpNext(t, answers)
		rpWant(t, "duplicate gone while waiting", a, http.StatusServiceUnavailable, "", "request cancelled", false)
		close(release)
		if f := <-done; f == nil || f.status != http.StatusCreated {
			t.Fatalf("first request: %+v", f)
		}
		rpNext(t, answers)
		rpRetryRunsOnce(t, e, url, "k-dup")
	})
	// The function honours the request's context and returns its error in
	// various shapes, some also holding an error of its own context.
	shapes := map[string]func(ctx context.Context) error{
		"ctx.Err()": func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() },
		"%w chain":  func(ctx context.Context) error { <-ctx.Done(); return fmt.Errorf("provider: %w", ctx.Err()) },
		"join with own deadline": func(ctx context.Context) error {
			own, cancel := context.WithTimeout(context.Background(), time.Millisecond)
			defer cancel()
			<-own.Done()
			<-ctx.Done()
			return errors.Join(fmt.Errorf("cache: %w", own.Err()), fmt.Errorf("provider: %w", ctx.Err()))
		},
		"own deadline only, request gone meanwhile": func(ctx context.Context) error {
			<-ctx.Done()
			own, cancel := context.WithTimeout(context.Background(), time.Millisecond)
			defer cancel()
			<-own.Done()
			return fmt.Errorf("provider: %w", own.Err())
		},
		"statement on the request's context": func(ctx context.Context) error {
			return nil // replaced below: needs the tx
		},
	}
	for name, shape := range shapes {
		t.Run("in the function/"+name, func(t *testing.T) {
			e := newEnv(t)
			logs := e.captureLogs()
			fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
				if name == "statement on the request's context" {
					_, err := tx.Exec(ctx, `SELECT pg_sleep(5)`)
					return err
				}
				return shape(ctx)
			})
			url, answers := rpServer(t, e.handler(idem.Endpoint{}))
			rpPostGone(t, url, "k-fn", nil)
			a := rpNext(t, answers)
			rpWant(t, name, a, http.StatusServiceUnavailable, "", "request cancelled; nothing was done", false)
			if l := logs.String(); l != "" {
				t.Fatalf("logged:\n%s", l)
			}
			fix()
			rpRetryRunsOnce(t, e, url, "k-fn")
		})
	}
}

// The client leaves while COMMIT runs (a deferred trigger sleeping), with
// a key and without, on pgx's default context watcher (the connection is
// closed: "Outcome unknown", never "request cancelled") and on one that
// sends a cancel request (the server ends the COMMIT with 57014, which
// rolled back: the cancellation's 503). The retry replays what committed
// or runs once.
func TestRevprobClientGoneDuringCommit(t *testing.T) {
	for _, cancelRequest := range []bool{false, true} {
		for _, key := range []string{"k-commit", ""} {
			t.Run(fmt.Sprintf("cancelRequest=%v/key=%q", cancelRequest, key), func(t *testing.T) {
				pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
					if cancelRequest {
						c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
							return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
						}
					}
				})
				e := newEnvPool(t, pool)
				logs := e.captureLogs()
				returned := rpSlowCommit(t, e)
				url, answers := rpServer(t, e.handler(idem.Endpoint{KeyOptional: key == ""}))
				rpPostGone(t, url, key, returned) // within the trigger's second
				a := rpNext(t, answers)
				switch {
				case cancelRequest:
					rpWant(t, "gone during COMMIT (57014)", a, http.StatusServiceUnavailable, "", "request cancelled; nothing was done", false)
				case key != "":
					rpWant(t, "gone during COMMIT", a, http.StatusServiceUnavailable, "Outcome unknown", "retry with the same idempotency key", true)
				default:
					rpWant(t, "gone during COMMIT", a, http.StatusServiceUnavailable, "Outcome unknown", "had no idempotency key", true)
				}
				if strings.Contains(logs.String(), "idempotent handler failed") || strings.Contains(logs.String(), "storage failed") {
					t.Fatalf("logged:\n%s", logs)
				}
				// Let the backend finish or roll back (its trigger sleeps
				// 1s; the connection check notices the closed socket within
				// 1s) before counting.
				time.Sleep(2500 * time.Millisecond)
				if cancelRequest && e.effects() != 0 {
					t.Fatalf("%d effects after a COMMIT ended by 57014", e.effects())
				}
				if key != "" {
					rpRetryRunsOnce(t, e, url, key)
				} else if n := e.effects(); n > 1 {
					t.Fatalf("%d effects", n)
				}
			})
		}
	}
}

// Shutdown past the drain deadline: a function that honours its context
// and one that ignores it (and would return success) both answer the
// cancellation's 503 and commit nothing; the retry on a new server runs
// once.
func TestRevprobShutdownPastDrain(t *testing.T) {
	for _, honours := range []bool{true, false} {
		t.Run(fmt.Sprintf("honours=%v", honours), func(t *testing.T) {
			e := newEnv(t)
			fix := e.hookUntilFixed(func(ctx context.Context, _ pgx.Tx) error {
				if honours {
					<-ctx.Done()
					return fmt.Errorf("provider: %w", ctx.Err())
				}
				time.Sleep(time.Second)
				return nil
			})
			tapped, answers := rpTap(e.handler(idem.Endpoint{}))
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			sctx, stop := context.WithCancel(context.Background())
			served := make(chan error, 1)
			go func() {
				served <- idem.ServeHTTP(sctx, &http.Server{Handler: tapped}, ln, idem.ServeConfig{NoNotReadyDelay: true, Drain: 300 * time.Millisecond})
			}()
			url := "http://" + ln.Addr().String() + "/charges"
			go func() { _, _ = rpPost(context.Background(), url, "k-shut", body1) }()
			rpWaitFor(t, "the function to run", func() bool { return e.calls.Load() == 1 })
			stop()
			a := rpNext(t, answers)
			if err := <-served; err != nil {
				t.Fatalf("ServeHTTP: %v", err)
			}
			rpWant(t, "shutdown past the drain", a, http.StatusServiceUnavailable, "", "request cancelled; nothing was done", false)
			rpWantNothingStored(t, e)
			fix()
			url2, _ := rpServer(t, e.handler(idem.Endpoint{}))
			rpRetryRunsOnce(t, e, url2, "k-shut")
		})
	}
}

// The request alive, a function returns errors of its own context in
// various shapes: each is the documented answer, logged as the function's
// failure, nothing stored, and the retry runs once.
func TestRevprobOwnContextErrorShapes(t *testing.T) {
	ownDeadline := func() error {
		c, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		defer cancel()
		<-c.Done()
		return c.Err()
	}
	ownCancel := func() error {
		c, cancel := context.WithCancel(context.Background())
		cancel()
		return c.Err()
	}
	const ownTitle = "Function's own context ended"
	cases := []struct {
		name   string
		err    func() error
		status int
		title  string
		detail string
	}{
		{"%w deadline", func() error { return fmt.Errorf("provider: %w", ownDeadline()) }, 500, ownTitle, "not the request's"},
		{"%w cancel", func() error { return fmt.Errorf("fan-out: %w", ownCancel()) }, 500, ownTitle, "not the request's"},
		{"errors.Join both", func() error { return errors.Join(ownDeadline(), ownCancel()) }, 500, ownTitle, "not the request's"},
		{"errors.Join with plain", func() error { return errors.Join(errors.New("boom"), ownDeadline()) }, 500, ownTitle, "not the request's"},
		{"two %w", func() error { return fmt.Errorf("a: %w; b: %w", errors.New("x"), ownCancel()) }, 500, ownTitle, "not the request's"},
		{"*idem.Error 504 wrapping it", func() error { return idem.Errorf(http.StatusGatewayTimeout, "provider: %w", ownDeadline()) }, 504, "", "provider"},
		{"join of *idem.Error and own ctx", func() error {
			return errors.Join(ownDeadline(), idem.Errorf(http.StatusConflict, "taken"))
		}, 409, "", "taken"},
		{"%v chain lost", func() error { return fmt.Errorf("provider: %v", ownDeadline()) }, 500, "Internal Server Error", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			logs := e.captureLogs()
			fix := e.hookUntilFixed(func(context.Context, pgx.Tx) error { return c.err() })
			url, answers := rpServer(t, e.handler(idem.Endpoint{}))
			got := rpMustPost(t, url, "k-own", body1)
			srv := rpNext(t, answers)
			if got.status != srv.status || !bytes.Equal(got.body, srv.body) {
				t.Fatalf("client saw %d %s, server wrote %d %s", got.status, got.body, srv.status, srv.body)
			}
			rpWant(t, c.name, *got, c.status, c.title, c.detail, false)
			if c.status >= 500 && !strings.Contains(logs.String(), "idempotent handler failed") {
				t.Fatalf("not logged as the function's failure:\n%s", logs)
			}
			rpWantNothingStored(t, e)
			fix()
			rpRetryRunsOnce(t, e, url, "k-own")
		})
	}
}

// The function's own deadline ends one of its statements (pgx closes the
// connection), the request alive: still "Statement ended by the
// function's own context", over a real client.
func TestRevprobOwnDeadlineEndsStatement(t *testing.T) {
	for _, ret := range []string{"pgx error", "own ctx.Err()", "joined with a plain error"} {
		t.Run(ret, func(t *testing.T) {
			e := newEnv(t)
			fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
				qctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
				defer cancel()
				_, err := tx.Exec(qctx, `SELECT pg_sleep(5)`)
				switch ret {
				case "own ctx.Err()":
					return qctx.Err()
				case "joined with a plain error":
					return errors.Join(errors.New("report"), err)
				}
				return err
			})
			url, answers := rpServer(t, e.handler(idem.Endpoint{}))
			a, _ := rpAsk(t, url, "k-stmt", answers)
			rpWant(t, ret, a, http.StatusInternalServerError, "Statement ended by the function's own context", "not the request's", false)
			fix()
			rpRetryRunsOnce(t, e, url, "k-stmt")
		})
	}
}

// A blackholed database (accepts TCP, never answers), a new connection
// needed: with connect_timeout within the wait, 503 "storage unavailable";
// without one, or a longer one, the wait runs out: 503 "Database busy". Both with Retry-After,
// function never called, the retry after runs once.
func TestRevprobBlackholedConnectTimeout(t *testing.T) {
	for _, ct := range []time.Duration{0, 500 * time.Millisecond, 5 * time.Second} {
		t.Run(fmt.Sprintf("connect_timeout=%v", ct), func(t *testing.T) {
			e, px := newEnvProxied(t, func(c *pgxpool.Config) { c.ConnConfig.ConnectTimeout = ct })
			logs := e.captureLogs()
			hurl, answers := rpServer(t, e.handler(idem.Endpoint{Wait: 2 * time.Second}))
			e.pool.Reset()
			px.Blackhole()
			a, took := rpAsk(t, hurl, "k-bh", answers)
			px.Restore()
			if ct > 0 && ct < 2*time.Second {
				rpWant(t, "connect timeout", a, http.StatusServiceUnavailable, "", "storage unavailable; nothing was done, retry later", true)
				if took > 1500*time.Millisecond || !strings.Contains(logs.String(), "idempotency storage failed") {
					t.Fatalf("took %v; log %s", took, logs)
				}
			} else {
				rpWant(t, "no connect timeout within the wait", a, http.StatusServiceUnavailable, "Database busy", "no connection or a lock within the wait", true)
			}
			if e.calls.Load() != 0 {
				t.Fatal("function ran")
			}
			rpRetryRunsOnce(t, e, hurl, "k-bh")
		})
	}
}

// Pool hooks that fail by a deadline of their own (not the wait): storage
// unavailable; a PrepareConn that blocks on the acquire's context until the
// wait runs out: Database busy.
func TestRevprobPoolHookTimeouts(t *testing.T) {
	ownTimeout := func(ctx context.Context, conn *pgx.Conn) error {
		c, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := conn.Exec(c, `SELECT pg_sleep(1)`)
		return fmt.Errorf("hook: %w", err)
	}
	hooks := map[string]struct {
		cfg           func(*pgxpool.Config, *atomic.Bool)
		title, detail string
		storageLogged bool
	}{
		"AfterConnect own timeout": {func(c *pgxpool.Config, broken *atomic.Bool) {
			c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
				if broken.Load() {
					return ownTimeout(ctx, conn)
				}
				return nil
			}
		}, "", "storage unavailable", true},
		"PrepareConn own timeout": {func(c *pgxpool.Config, broken *atomic.Bool) {
			c.PrepareConn = func(ctx context.Context, conn *pgx.Conn) (bool, error) {
				if broken.Load() {
					err := ownTimeout(ctx, conn)
					return false, err
				}
				return true, nil
			}
		}, "", "storage unavailable", true},
		"PrepareConn waits on the acquire's context": {func(c *pgxpool.Config, broken *atomic.Bool) {
			c.PrepareConn = func(ctx context.Context, conn *pgx.Conn) (bool, error) {
				if broken.Load() {
					_, err := conn.Exec(ctx, `SELECT pg_sleep(5)`)
					return false, err
				}
				return true, nil
			}
		}, "Database busy", "within the wait", false},
	}
	for name, h := range hooks {
		t.Run(name, func(t *testing.T) {
			var broken atomic.Bool
			pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { h.cfg(c, &broken) })
			e := newEnvPool(t, pool)
			logs := e.captureLogs()
			url, answers := rpServer(t, e.handler(idem.Endpoint{Wait: time.Second}))
			pool.Reset()
			broken.Store(true)
			a, _ := rpAsk(t, url, "k-hook", answers)
			broken.Store(false)
			rpWant(t, name, a, http.StatusServiceUnavailable, h.title, h.detail, true)
			if h.storageLogged != strings.Contains(logs.String(), "idempotency storage failed") {
				t.Fatalf("log:\n%s", logs)
			}
			if e.calls.Load() != 0 {
				t.Fatal("function ran")
			}
			rpRetryRunsOnce(t, e, url, "k-hook")
		})
	}
}

// A pool whose context watcher sends a cancel request
// (pgconn.CancelRequestContextWatcherHandler): the function's own deadline
// ends its statement with the server's 57014, the connection open and the
// error holding no context error. The answer is the 500 "Statement
// cancelled" (the function's failure, no Retry-After, key free), but its
// detail blamed only "the database (statement_timeout, or an operator)":
// neither happened. It names the function's own context as a possible
// cause now.
func TestRevprobOwnDeadlineCancelRequestWatcher(t *testing.T) {
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 5 * time.Second}
		}
	})
	e := newEnvPool(t, pool)
	logs := e.captureLogs()
	fix := e.hookUntilFixed(func(ctx context.Context, tx pgx.Tx) error {
		qctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		_, err := tx.Exec(qctx, `SELECT pg_sleep(5)`)
		return fmt.Errorf("slow query: %w", err)
	})
	url, answers := rpServer(t, e.handler(idem.Endpoint{}))
	a, _ := rpAsk(t, url, "k-cr", answers)
	rpWant(t, "own deadline, cancel request", a, http.StatusInternalServerError, "Statement cancelled", "of the function's own", false)
	if !strings.Contains(logs.String(), "idempotent handler failed") {
		t.Fatalf("log:\n%s", logs)
	}
	rpWantNothingStored(t, e)
	fix()
	rpRetryRunsOnce(t, e, url, "k-cr")
}

// As TestRevprobClientGoneDuringCommit, the client retrying at once, while
// the abandoned COMMIT's backend may still run: the retry waits for the
// key (in flight elsewhere), then replays what committed or runs once;
// never a second effect, never a 409 within the wait.
func TestRevprobImmediateRetryAfterCommitUnknown(t *testing.T) {
	e := newEnv(t)
	returned := rpSlowCommit(t, e)
	url, answers := rpServer(t, e.handler(idem.Endpoint{}))
	rpPostGone(t, url, "k-now", returned)
	a := rpNext(t, answers)
	rpWant(t, "gone during COMMIT", a, http.StatusServiceUnavailable, "Outcome unknown", "retry with the same idempotency key", true)
	r := rpMustPost(t, url, "k-now", body1)
	if r.status != http.StatusCreated {
		t.Fatalf("immediate retry: %d %s", r.status, r.body)
	}
	replayed := r.header.Get("Idempotent-Replayed") == "true"
	if e.effects() != 1 || e.keys() != 1 || (replayed && e.calls.Load() != 1) || (!replayed && e.calls.Load() != 2) {
		t.Fatalf("immediate retry (replayed %v): %d effects, %d keys, %d calls", replayed, e.effects(), e.keys(), e.calls.Load())
	}
	t.Logf("immediate retry replayed=%v", replayed)
}

// The database down (connection refused), a new connection needed: 503
// "storage unavailable" at once, logged, with Retry-After; never "Database
// busy" nor "request cancelled".
func TestRevprobDatabaseDownIsStorageUnavailable(t *testing.T) {
	e, px := newEnvProxied(t, nil)
	logs := e.captureLogs()
	hurl, answers := rpServer(t, e.handler(idem.Endpoint{Wait: 5 * time.Second}))
	e.pool.Reset()
	px.Down()
	a, took := rpAsk(t, hurl, "k-down", answers)
	px.Restore()
	rpWant(t, "database down", a, http.StatusServiceUnavailable, "", "storage unavailable; nothing was done, retry later", true)
	if took > 2*time.Second || !strings.Contains(logs.String(), "idempotency storage failed") || e.calls.Load() != 0 {
		t.Fatalf("took %v, %d calls; log %s", took, e.calls.Load(), logs)
	}
	rpRetryRunsOnce(t, e, hurl, "k-down")
}
