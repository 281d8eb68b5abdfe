package idem

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The downstream client's behaviour against real HTTP servers. The
// operation's key is put in the context the way Handle and the event
// processor do; client_op_test.go runs the client inside real operations.

// hit is one request as the server saw it, timed by the server's clock.
type hit struct {
	at     time.Time
	method string
	key    string
	body   string
}

// recorder is an httptest server that records every request and answers
// with respond(n, w, r) for the n-th request (1-based).
type recorder struct {
	srv     *httptest.Server
	mu      sync.Mutex
	hits    []hit
	sent    []time.Time // when each response was handed to the connection
	respond func(n int, w http.ResponseWriter, r *http.Request)
}

func newRecorder(t *testing.T, respond func(n int, w http.ResponseWriter, r *http.Request)) *recorder {
	t.Helper()
	rec := &recorder{respond: respond}
	rec.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rec.mu.Lock()
		rec.hits = append(rec.hits, hit{at: time.Now(), method: r.Method, key: r.Header.Get("Idempotency-Key"), body: string(body)})
		n := len(rec.hits)
		rec.mu.Unlock()
		rec.respond(n, w, r)
		rec.mu.Lock()
		rec.sent = append(rec.sent, time.Now())
		rec.mu.Unlock()
	}))
	t.Cleanup(rec.srv.Close)
	return rec
}

func (rec *recorder) all() []hit {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]hit(nil), rec.hits...)
}

func (rec *recorder) sentAt(i int) time.Time {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.sent[i]
}

// status answers the listed statuses in turn, then 201.
func status(codes ...int) func(int, http.ResponseWriter, *http.Request) {
	return func(n int, w http.ResponseWriter, _ *http.Request) {
		if n <= len(codes) {
			w.WriteHeader(codes[n-1])
			return
		}
		w.WriteHeader(http.StatusCreated)
	}
}

// opContext is ctx inside an operation with key k, as Handle makes it.
func opContext(ctx context.Context, k Key) context.Context {
	return context.WithValue(ctx, keyCtx{}, k)
}

var opKey = Key{Scope: "payments.charge", Principal: "tenant-1", Key: "pay-123"}

// fast retries in microseconds, so only Retry-After makes a test wait.
var fast = ClientConfig{Retry: RetryPolicy{MaxAttempts: 5, Initial: time.Millisecond, Max: 2 * time.Millisecond}}

func post(t *testing.T, ctx context.Context, c *http.Client, u, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return resp, err
}

func TestClientSameKeyOnEveryAttempt(t *testing.T) {
	rec := newRecorder(t, func(n int, w http.ResponseWriter, r *http.Request) {
		switch n {
		case 1:
			w.WriteHeader(http.StatusServiceUnavailable)
		case 2:
			w.WriteHeader(http.StatusTooManyRequests)
		case 3: // a transport error: the connection dies without an answer
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	c := NewClient(nil, fast)
	ctx := WithCallName(opContext(context.Background(), opKey), "provider.charge")
	resp, err := post(t, ctx, c, rec.srv.URL, `{"amount":100}`)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("got %v %v, want 201", resp, err)
	}
	hits := rec.all()
	if len(hits) != 4 {
		t.Fatalf("%d attempts, want 4", len(hits))
	}
	want := opKey.Derive("provider.charge")
	for i, h := range hits {
		if h.key != want || h.body != `{"amount":100}` {
			t.Fatalf("attempt %d: key %q body %q; want key %q and the same body every time", i+1, h.key, h.body, want)
		}
	}
}

func TestClientKeyPerCallName(t *testing.T) {
	rec := newRecorder(t, status())
	c := NewClient(nil, fast)
	op := opContext(context.Background(), opKey)
	other := opContext(context.Background(), Key{Scope: opKey.Scope, Principal: opKey.Principal, Key: "pay-456"})
	for _, ctx := range []context.Context{
		WithCallName(op, "charge"),
		WithCallName(op, "refund"),
		WithCallName(op, "charge"), // the same call again: the same key
		WithCallName(other, "charge"),
	} {
		if _, err := post(t, ctx, c, rec.srv.URL, "{}"); err != nil {
			t.Fatal(err)
		}
	}
	req, _ := http.NewRequestWithContext(op, http.MethodPost, rec.srv.URL, nil)
	if resp, err := c.Do(NameRequest(req, "refund")); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
	h := rec.all()
	if h[0].key == h[1].key || h[0].key == h[3].key || h[1].key == h[3].key {
		t.Fatalf("distinct calls share a key: %q %q %q", h[0].key, h[1].key, h[3].key)
	}
	if h[0].key != h[2].key || h[1].key != h[4].key {
		t.Fatalf("one call, two keys: %q/%q, %q/%q", h[0].key, h[2].key, h[1].key, h[4].key)
	}
	if k, _ := CallKey(op, "charge"); k != h[0].key {
		t.Fatalf("CallKey = %q, the client sent %q", k, h[0].key)
	}
}

// The server's clock: the second attempt arrives no earlier than the
// Retry-After delay after the first answer left, although the backoff alone
// would have retried within milliseconds.
func TestClientHonoursRetryAfterSeconds(t *testing.T) {
	rec := newRecorder(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		if n == 1 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	if resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}"); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("got %v %v", resp, err)
	}
	hits := rec.all()
	if len(hits) != 2 {
		t.Fatalf("%d attempts, want 2", len(hits))
	}
	if gap := hits[1].at.Sub(rec.sentAt(0)); gap < time.Second {
		t.Fatalf("second attempt %v after the 503 with Retry-After: 1", gap)
	}
}

func TestClientHonoursRetryAfterDate(t *testing.T) {
	var until time.Time
	rec := newRecorder(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		if n == 1 {
			date := time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
			until, _ = http.ParseTime(date) // what the header promises, to the second
			w.Header().Set("Retry-After", date)
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	if resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}"); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("got %v %v", resp, err)
	}
	hits := rec.all()
	if len(hits) != 2 || hits[1].at.Before(until) {
		t.Fatalf("%d attempts; second at %v, want not before the Retry-After date %v", len(hits), hits[len(hits)-1].at, until)
	}
}

// A Retry-After longer than MaxRetryAfter is not shortened: the response
// goes back to the caller.
func TestClientRetryAfterBeyondCapReturnsResponse(t *testing.T) {
	rec := newRecorder(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Retry-After", "3600")
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	cfg := fast
	cfg.MaxRetryAfter = time.Second
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	resp, err := post(t, ctx, NewClient(nil, cfg), rec.srv.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(rec.all()) != 1 {
		t.Fatalf("got %v %v after %d attempts; want the 503 after 1", resp, err, len(rec.all()))
	}
}

func TestClientStopsAfterMaxAttempts(t *testing.T) {
	rec := newRecorder(t, status(500, 502, 503, 504, 500, 500))
	cfg := fast
	cfg.Retry.MaxAttempts = 3
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	resp, err := post(t, ctx, NewClient(nil, cfg), rec.srv.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(rec.all()) != 3 {
		t.Fatalf("got %v %v after %d attempts; want the third answer (503) after 3", resp, err, len(rec.all()))
	}
}

func TestClientDoesNotRetryOtherStatuses(t *testing.T) {
	for _, code := range []int{http.StatusBadRequest, http.StatusUnprocessableEntity, http.StatusPaymentRequired} {
		rec := newRecorder(t, status(code))
		ctx := WithCallName(opContext(context.Background(), opKey), "charge")
		resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}")
		if err != nil || resp.StatusCode != code || len(rec.all()) != 1 {
			t.Fatalf("%d: got %v %v after %d attempts; want it returned after 1", code, resp, err, len(rec.all()))
		}
	}
	// Configurable: a client that also retries 422.
	rec := newRecorder(t, status(http.StatusUnprocessableEntity))
	cfg := fast
	cfg.RetryStatus = func(s int) bool { return s == http.StatusUnprocessableEntity }
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	if resp, err := post(t, ctx, NewClient(nil, cfg), rec.srv.URL, "{}"); err != nil || resp.StatusCode != http.StatusCreated || len(rec.all()) != 2 {
		t.Fatalf("custom RetryStatus: got %v %v after %d attempts", resp, err, len(rec.all()))
	}
}

// onlyReader hides strings.Reader's type, so http.NewRequest cannot set
// GetBody: the body can be sent once.
type onlyReader struct{ io.Reader }

func TestClientNeverRetriesUnreplayableBody(t *testing.T) {
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	rec := newRecorder(t, status(http.StatusServiceUnavailable))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rec.srv.URL, onlyReader{strings.NewReader("{}")})
	if req.GetBody != nil {
		t.Fatal("test setup: the body is replayable")
	}
	resp, err := NewClient(nil, fast).Do(req)
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(rec.all()) != 1 {
		t.Fatalf("got %v %v after %d attempts; want the 503 after 1", resp, err, len(rec.all()))
	}
	resp.Body.Close()

	// A transport error is not retried either: the body is gone.
	cut := newRecorder(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
	})
	req, _ = http.NewRequestWithContext(ctx, http.MethodPost, cut.srv.URL, onlyReader{strings.NewReader("{}")})
	if _, err := NewClient(nil, fast).Do(req); err == nil || len(cut.all()) != 1 {
		t.Fatalf("got %v after %d attempts; want the transport error after 1", err, len(cut.all()))
	}
}

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// Cancelled while waiting out a 60s Retry-After: RoundTrip returns at once
// with ctx.Err() itself.
func TestClientCancelDuringBackoff(t *testing.T) {
	cfg := fast
	cfg.MaxRetryAfter = 2 * time.Minute
	for _, via := range []string{"transport", "client"} {
		t.Run(via, func(t *testing.T) {
			rec := newRecorder(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Retry-After", "60")
				w.WriteHeader(http.StatusServiceUnavailable)
			})
			// answered is signalled when the 503 is in the client's hands:
			// from then on it is waiting out the 60s.
			answered := make(chan struct{}, 1)
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				resp, err := http.DefaultTransport.RoundTrip(r)
				answered <- struct{}{}
				return resp, err
			})
			ctx, cancel := context.WithCancel(WithCallName(opContext(context.Background(), opKey), "charge"))
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
			done := make(chan error, 1)
			go func() {
				var resp *http.Response
				var err error
				if via == "transport" {
					resp, err = NewTransport(base, cfg).RoundTrip(req)
				} else {
					resp, err = NewClient(base, cfg).Do(req)
				}
				if resp != nil {
					resp.Body.Close()
					err = errors.New("got a response")
				}
				done <- err
			}()
			<-answered
			cancel()
			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("still waiting out Retry-After after the context was cancelled")
			}
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			var ue *url.Error
			if via == "transport" && err != ctx.Err() {
				t.Fatalf("RoundTrip returned %#v, want ctx.Err() itself", err)
			} else if via == "client" && (!errors.As(err, &ue) || ue.Err != ctx.Err()) {
				t.Fatalf("Do returned %#v, want the standard *url.Error around ctx.Err() itself", err)
			}
			if n := len(rec.all()); n != 1 {
				t.Fatalf("%d attempts, want 1", n)
			}
		})
	}
}

func waitHits(t *testing.T, rec *recorder, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(rec.all()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("server saw %d requests, want %d", len(rec.all()), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Cancelled while an attempt is in flight (the server never answers).
func TestClientCancelDuringAttempt(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	rec := newRecorder(t, func(_ int, w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	ctx, cancel := context.WithCancel(WithCallName(opContext(context.Background(), opKey), "charge"))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
	done := make(chan error, 1)
	go func() {
		resp, err := NewTransport(nil, fast).RoundTrip(req)
		if resp != nil {
			resp.Body.Close()
		}
		done <- err
	}()
	waitHits(t, rec, 1)
	cancel()
	select {
	case err := <-done:
		if err != ctx.Err() {
			t.Fatalf("RoundTrip returned %#v, want ctx.Err() itself", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("RoundTrip did not return after cancellation")
	}
	if n := len(rec.all()); n != 1 {
		t.Fatalf("%d attempts; a cancelled call must not be retried", n)
	}
}

func TestClientRefusesUnsafeWithoutKey(t *testing.T) {
	rec := newRecorder(t, status())
	c := NewClient(nil, fast)
	for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		req, _ := http.NewRequestWithContext(WithCallName(context.Background(), "charge"), method, rec.srv.URL, strings.NewReader("{}"))
		if _, err := c.Do(req); !errors.Is(err, ErrNoOperationKey) {
			t.Fatalf("%s outside an operation: err = %v, want ErrNoOperationKey", method, err)
		}
		req, _ = http.NewRequestWithContext(opContext(context.Background(), opKey), method, rec.srv.URL, nil)
		if _, err := c.Do(req); !errors.Is(err, ErrNoCallName) {
			t.Fatalf("%s without a call name: err = %v, want ErrNoCallName", method, err)
		}
	}
	if n := len(rec.all()); n != 0 {
		t.Fatalf("the server saw %d refused requests", n)
	}
	// The caller's own key is sent as is, inside an operation or not.
	for _, ctx := range []context.Context{context.Background(), WithCallName(opContext(context.Background(), opKey), "charge")} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "caller-chosen")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	for _, h := range rec.all() {
		if h.key != "caller-chosen" {
			t.Fatalf("sent key %q, want the caller's", h.key)
		}
	}
}

func TestClientSafeMethodsPassThrough(t *testing.T) {
	rec := newRecorder(t, status(http.StatusServiceUnavailable))
	req, _ := http.NewRequest(http.MethodGet, rec.srv.URL, nil)
	resp, err := NewClient(nil, fast).Do(req)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("GET outside an operation: %v %v", resp, err)
	}
	resp.Body.Close()
	for _, h := range rec.all() {
		if h.key != "" {
			t.Fatalf("GET sent Idempotency-Key %q", h.key)
		}
	}
	if n := len(rec.all()); n != 2 {
		t.Fatalf("%d attempts; a GET is retried like any call (want 2)", n)
	}
	if req.Header.Get("Idempotency-Key") != "" {
		t.Fatal("the caller's request was modified")
	}
}

func TestRetryAfterParse(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, c := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true},
		{" 7 ", 7 * time.Second, true},
		{"-1", 0, false},
		{"soon", 0, false},
		{"", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
		{"Fri, 02 Jan 2026 03:06:05 GMT", 2 * time.Minute, true},
		{strconv.FormatInt(1<<62, 10), 365 * 24 * time.Hour, true},
		{"99999999999999999999", 365 * 24 * time.Hour, true}, // beyond int64: much later
		{"-99999999999999999999", 0, false},
	} {
		got, ok := retryAfter(c.in, now)
		if got != c.want || ok != c.ok {
			t.Errorf("retryAfter(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}
