package idem

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"
)

// Faults an outside reviewer threw at the downstream client (see
// notes/clientfix.md): stalled bodies, odd Retry-After values, deadlines,
// redirects, odd headers and call names.

// A 503 whose body stalls after a few bytes (Content-Length promises more)
// is not drained before the retry: no timeout covers a response body, so a
// drain would wait for as long as the server stalls — forever under a
// context without a deadline. The retry goes out and gets the 201.
func TestClientRetryDoesNotWaitOnStalledBody(t *testing.T) {
	release := make(chan struct{})
	rec := newRecorder(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		if n == 1 {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("0123456789"))
			w.(http.Flusher).Flush()
			<-release // the other 90 bytes never come
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	t.Cleanup(func() { close(release) }) // before the server's Close waits for this handler
	// The deadline only keeps a failing run finite: a client that drains
	// returns its DeadlineExceeded instead of the 201.
	ctx, cancel := context.WithTimeout(WithCallName(opContext(context.Background(), opKey), "charge"), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
	resp, err := NewTransport(nil, fast).RoundTrip(req)
	if err != nil {
		t.Fatalf("RoundTrip: %v; want the retry's 201, not a wait on the stalled 503 body", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || len(rec.all()) != 2 {
		t.Fatalf("got %d after %d attempts, want 201 after 2", resp.StatusCode, len(rec.all()))
	}
}

// A Retry-After with more seconds than an int64 holds asks for "much
// later": the response goes back to the caller (beyond MaxRetryAfter), it is
// not taken for garbage and retried at once.
func TestClientRetryAfterOverflowIsLong(t *testing.T) {
	rec := newRecorder(t, func(n int, w http.ResponseWriter, _ *http.Request) {
		if n == 1 {
			w.Header().Set("Retry-After", "99999999999999999999")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(rec.all()) != 1 {
		t.Fatalf("got %v %v after %d attempts; want the 503 after 1", resp, err, len(rec.all()))
	}
}

// Retry-After values a server may send that mean "now" or nothing (0, a
// negative number, garbage, a fraction, a date in the past): the client
// retries after its own backoff and gets the 201.
func TestClientRetryAfterOddValues(t *testing.T) {
	for _, v := range []string{"0", "-5", "soon", "1.5", "Sat, 01 Jan 2000 00:00:00 GMT"} {
		rec := newRecorder(t, func(n int, w http.ResponseWriter, _ *http.Request) {
			if n == 1 {
				w.Header().Set("Retry-After", v)
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		ctx := WithCallName(opContext(context.Background(), opKey), "charge")
		resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}")
		if err != nil || resp.StatusCode != http.StatusCreated || len(rec.all()) != 2 {
			t.Fatalf("Retry-After %q: got %v %v after %d attempts; want 201 after 2", v, resp, err, len(rec.all()))
		}
	}
}

// The caller's deadline ends before the Retry-After the server asked for:
// the client does not sit out a wait that cannot end in a retry (holding
// the caller's transaction); it hands back the server's answer at once.
func TestClientDeadlineBeforeRetryAfterReturnsResponse(t *testing.T) {
	rec := newRecorder(t, func(_ int, w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Retry-After", "20")
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	ctx, cancel := context.WithTimeout(WithCallName(opContext(context.Background(), opKey), "charge"), 10*time.Second)
	defer cancel()
	resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(rec.all()) != 1 {
		t.Fatalf("got %v %v after %d attempts; want the 503 after 1, before the deadline", resp, err, len(rec.all()))
	}
	if ctx.Err() != nil {
		t.Fatal("the client waited into the deadline")
	}
}

// The same for a transport error whose backoff outlasts the deadline: the
// error comes back now, wrapped, saying why it was not retried.
func TestClientDeadlineBeforeBackoffReturnsError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: connection refused
	cfg := ClientConfig{Retry: RetryPolicy{MaxAttempts: 5, Initial: time.Minute, Max: time.Minute}}
	ctx, cancel := context.WithTimeout(WithCallName(opContext(context.Background(), opKey), "charge"), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr, strings.NewReader("{}"))
	_, err = NewTransport(nil, cfg).RoundTrip(req)
	var opErr *net.OpError
	if err == nil || !errors.As(err, &opErr) || !strings.Contains(err.Error(), "deadline comes first") || ctx.Err() != nil {
		t.Fatalf("RoundTrip: %v (ctx %v); want the dial error now, not a wait into the deadline", err, ctx.Err())
	}
}

// 307 and 308 on a POST: net/http follows them with the body replayed
// (GetBody); the redirected request goes through the transport again with
// the same context, so it carries the same key and the same body.
func TestClientRedirectKeepsKeyAndBody(t *testing.T) {
	for _, code := range []int{http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		rec := newRecorder(t, func(_ int, w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/charges" {
				w.Header().Set("Location", "/v2/charges")
				w.WriteHeader(code)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		ctx := WithCallName(opContext(context.Background(), opKey), "charge")
		resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL+"/charges", `{"amount":1}`)
		if err != nil || resp.StatusCode != http.StatusCreated {
			t.Fatalf("%d: got %v %v", code, resp, err)
		}
		hits := rec.all()
		if len(hits) != 2 {
			t.Fatalf("%d: %d requests, want 2", code, len(hits))
		}
		for _, h := range hits {
			if h.method != http.MethodPost || h.key != opKey.Derive("charge") || h.body != `{"amount":1}` {
				t.Fatalf("%d: %s key %q body %q; want POST, the call's key and the body on both", code, h.method, h.key, h.body)
			}
		}
	}
}

// A key header set to the empty string is no key: inside an operation the
// derived key is sent, outside one the request is refused.
func TestClientEmptyKeyHeaderIsNoKey(t *testing.T) {
	rec := newRecorder(t, status())
	c := NewClient(nil, fast)
	req, _ := http.NewRequestWithContext(WithCallName(opContext(context.Background(), opKey), "charge"), http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if k := rec.all()[0].key; k != opKey.Derive("charge") {
		t.Fatalf("sent %q, want the derived key", k)
	}
	req, _ = http.NewRequestWithContext(context.Background(), http.MethodPost, rec.srv.URL, strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "")
	if _, err := c.Do(req); !errors.Is(err, ErrNoOperationKey) {
		t.Fatalf("empty header outside an operation: %v, want ErrNoOperationKey", err)
	}
}

// Any call name — non-ASCII, 100 kB long, with NUL or invalid UTF-8 —
// gives a 32-character hex key: always a valid header value, far below the
// 255 bytes MaxKeyLength and the provider accept, and distinct per name.
func TestClientKeyForAnyCallName(t *testing.T) {
	rec := newRecorder(t, status())
	names := []string{"заказ.списание", strings.Repeat("n", 100_000), "a\x00b", "\xff\xfe"}
	for _, name := range names {
		ctx := WithCallName(opContext(context.Background(), opKey), name)
		if resp, err := post(t, ctx, NewClient(nil, fast), rec.srv.URL, "{}"); err != nil || resp.StatusCode != http.StatusCreated {
			t.Fatalf("name %.20q: %v %v", name, resp, err)
		}
	}
	seen := map[string]bool{}
	for i, h := range rec.all() {
		if len(h.key) != 32 || strings.Trim(h.key, "0123456789abcdef") != "" || seen[h.key] || h.key != opKey.Derive(names[i]) {
			t.Fatalf("name %.20q: key %q; want its own 32 hex characters", names[i], h.key)
		}
		seen[h.key] = true
	}
}

// http.Client.CloseIdleConnections asks only its own Transport: the idem
// transport passes it on to the base, or the base's idle connections could
// not be closed through NewClient's client (the payments demo relies on it
// to lose a provider answer on a fresh connection).
func TestClientCloseIdleConnectionsReachesBase(t *testing.T) {
	rec := newRecorder(t, status())
	base := &http.Transport{}
	c := NewClient(base, fast)
	var reused []bool
	for range 2 {
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = append(reused, i.Reused) }}
		ctx := httptrace.WithClientTrace(WithCallName(opContext(context.Background(), opKey), "charge"), trace)
		if resp, err := post(t, ctx, c, rec.srv.URL, "{}"); err != nil || resp.StatusCode != http.StatusCreated {
			t.Fatalf("%v %v", resp, err)
		}
		c.CloseIdleConnections()
	}
	if len(reused) != 2 || reused[1] {
		t.Fatalf("connections reused: %v; want a fresh connection after CloseIdleConnections", reused)
	}
}

// The server reads half of a replayable body and resets the connection: the
// retry replays the whole body (GetBody) with the same key.
func TestClientBodyCutHalfwayIsReplayedWhole(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	body := strings.Repeat("x", 1<<20)
	type got struct {
		key  string
		body int
	}
	second := make(chan got, 1)
	go func() {
		for n := 1; ; n++ {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			req, err := http.ReadRequest(bufio.NewReader(conn))
			if err != nil {
				conn.Close()
				continue
			}
			if n == 1 {
				_, _ = io.CopyN(io.Discard, req.Body, int64(len(body)/2))
				_ = conn.(*net.TCPConn).SetLinger(0) // RST, not FIN
				conn.Close()
				continue
			}
			b, _ := io.ReadAll(req.Body)
			second <- got{req.Header.Get("Idempotency-Key"), len(b)}
			_, _ = io.WriteString(conn, "HTTP/1.1 201 Created\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			conn.Close()
		}
	}()
	ctx := WithCallName(opContext(context.Background(), opKey), "charge")
	resp, err := post(t, ctx, NewClient(nil, fast), "http://"+ln.Addr().String(), body)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("got %v %v, want the retry's 201", resp, err)
	}
	g := <-second
	if g.key != opKey.Derive("charge") || g.body != len(body) {
		t.Fatalf("retry carried key %q and %d body bytes; want the call's key and all %d", g.key, g.body, len(body))
	}
}
