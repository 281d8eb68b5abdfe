package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// A context error in an answer's cause is the request's cancellation only
// when the request's context has ended (the client went away, or ServeHTTP
// cancelled it at the drain deadline). Every error wrapping
// context.Canceled or context.DeadlineExceeded was answered 503 "request
// cancelled; nothing was done", without Retry-After and without a log
// line, while the client was still there waiting for the answer.

// problemDetail is the detail of the problem+json body of r.
func problemDetail(t *testing.T, r result) string {
	t.Helper()
	var p struct{ Detail string }
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
	return p.Detail
}

// hangingUpstream is a third party that never answers (until the test
// ends): a call to it ends only by its caller's deadline or cancel.
func hangingUpstream(t *testing.T) string {
	t.Helper()
	release := make(chan struct{})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(s.Close)
	t.Cleanup(func() { close(release) }) // before s.Close, which waits for the handlers
	return s.URL
}

// callUpstream is a function's call to a third party under a context of
// its own: a deadline of 100ms, or a cancel of its own 100ms in (a
// fan-out whose other branch failed). Its error wraps the context's error,
// as net/http's client reports it, and the function returns it wrapped.
func callUpstream(ctx context.Context, url string, cancelled bool) error {
	var cctx context.Context
	var cancel context.CancelFunc
	if cancelled {
		cctx, cancel = context.WithCancel(ctx)
		time.AfterFunc(100*time.Millisecond, cancel)
	} else {
		cctx, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
	}
	defer cancel()
	req, err := http.NewRequestWithContext(cctx, http.MethodPost, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("payment provider: %w", err)
	}
	resp.Body.Close()
	return nil
}

// newEnvProxied is newEnv on a pool (configured by mod, if not nil) whose
// connections pass through the returned fault proxy.
func newEnvProxied(t *testing.T, mod func(*pgxpool.Config)) (*env, *faultproxy.Proxy) {
	t.Helper()
	url := pgtest.Schema(t)
	px := faultproxy.New(t, faultproxy.PostgresTarget(url))
	return newEnvPool(t, pgtest.PoolURL(t, px.RewriteURL(url), mod)), px
}

// The function's own error wraps a context error of its own (its deadline
// on a call to a third party, a cancel of its own), the request alive: it
// is the function's failure, a 500 logged as one (never the cancellation's
// 503, which it was, unlogged); its transaction rolled back, nothing is
// stored, and the key is free: the retry runs the function again.
func TestFunctionOwnContextErrorIs500(t *testing.T) {
	t.Parallel()
	upstream := hangingUpstream(t)
	for _, cancelled := range []bool{false, true} {
		for _, keyed := range []bool{true, false} {
			t.Run(fmt.Sprintf("cancelled=%v/keyed=%v", cancelled, keyed), func(t *testing.T) {
				e := newEnv(t)
				logs := e.captureLogs()
				fix := e.hookUntilFixed(func(ctx context.Context, _ pgx.Tx) error { return callUpstream(ctx, upstream, cancelled) })
				h := e.handler(idem.Endpoint{KeyOptional: !keyed})
				key := ""
				if keyed {
					key = "k-upstream"
				}
				r := do(h, key, body1)
				wantProblem(t, r, http.StatusInternalServerError)
				if d := problemDetail(t, r); !strings.Contains(d, "not the request's") || !strings.Contains(d, "rolled back") || r.header.Get("Retry-After") != "" {
					t.Fatalf("%d %s (Retry-After %q); want a 500 saying the function's own context ended it and it rolled back, without Retry-After",
						r.status, r.body, r.header.Get("Retry-After"))
				}
				if l := logs.String(); !strings.Contains(l, "idempotent handler failed") || !strings.Contains(l, "payment provider") {
					t.Fatalf("log:\n%s\nwant the function's failure logged with its error", l)
				}
				wantRetryRunsAgain(t, e, h, key, fix)
			})
		}
	}
}

// The same function with the request cancelled while it waits on the third
// party: the cancellation's 503, as before, unlogged as a failure.
func TestFunctionCallCancelledWithRequestIs503(t *testing.T) {
	e := newEnv(t)
	logs := e.captureLogs()
	upstream := hangingUpstream(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.hook = func(fctx context.Context, _ pgx.Tx, _ chargeReq) error {
		time.AfterFunc(50*time.Millisecond, cancel) // the client goes away during the call
		return callUpstream(fctx, upstream, false)
	}
	r := doCtx(ctx, e.handler(idem.Endpoint{}), "k-gone", body1)
	wantProblem(t, r, http.StatusServiceUnavailable)
	if d := problemDetail(t, r); d != "request cancelled; nothing was done" {
		t.Fatalf("%d %s; want the cancellation's 503", r.status, r.body)
	}
	if l := logs.String(); l != "" {
		t.Fatalf("a cancelled request logged:\n%s", l)
	}
	if e.effects() != 0 || e.keys() != 0 {
		t.Fatalf("%d effects, %d keys, want 0, 0", e.effects(), e.keys())
	}
}

// A storage failure whose cause is a deadline that is not the request's:
// the pool's connect timeout (pgconn's ConnectTimeout, connect_timeout in
// the URL) fires on a database that accepts the TCP connection and never
// answers, well within the endpoint's wait, the client still there. It was
// answered 503 "Database busy ... no connection or a lock within the wait"
// (there was no wait), and, once that was told apart, "request cancelled"
// without Retry-After or a log line. It is the storage failure it is: 503
// storage unavailable, logged, with Retry-After; the function never ran,
// and once the database answers the same key runs it.
func TestConnectTimeoutIsStorageUnavailable(t *testing.T) {
	e, px := newEnvProxied(t, func(c *pgxpool.Config) { c.ConnConfig.ConnectTimeout = time.Second })
	logs := e.captureLogs()
	h := e.handler(idem.Endpoint{Wait: 10 * time.Second})
	e.pool.Reset() // the request dials a new connection, into the partition
	px.Blackhole()
	r := do(h, "k-connect", body1)
	px.Restore()
	wantProblem(t, r, http.StatusServiceUnavailable)
	if d := problemDetail(t, r); !strings.Contains(d, "storage unavailable") || r.header.Get("Retry-After") == "" {
		t.Fatalf("%d %s (Retry-After %q); want a 503 storage unavailable with Retry-After", r.status, r.body, r.header.Get("Retry-After"))
	}
	if l := logs.String(); !strings.Contains(l, "idempotency storage failed") {
		t.Fatalf("log:\n%s\nwant the storage failure logged", l)
	}
	if e.calls.Load() != 0 {
		t.Fatalf("the function ran %d times during the partition, want 0", e.calls.Load())
	}
	r = do(h, "k-connect", body1)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("after the partition: %d %s, want 201 from a run", r.status, r.body)
	}
	if e.calls.Load() != 1 || e.effects() != 1 {
		t.Fatalf("%d calls, %d effects, want 1, 1", e.calls.Load(), e.effects())
	}
}
