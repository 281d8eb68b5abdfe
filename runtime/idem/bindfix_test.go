package idem_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
)

// rawRequest writes one HTTP/1.1 request to addr byte for byte (so nothing
// normalises the target) and returns the status and body.
func rawRequest(t *testing.T, addr, method, target string, header ...string) (int, string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n", method, target)
	for i := 0; i+1 < len(header); i += 2 {
		fmt.Fprintf(&b, "%s: %s\r\n", header[i], header[i+1])
	}
	b.WriteString("\r\n")
	if _, err := io.WriteString(conn, b.String()); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		// The server dropped the connection: no response at all.
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// A query that does not parse (a ';' separator, a bad % escape) made
// url.Values drop the pair silently: ?dry_run=true; reached the function as
// dry_run=false, and ran it. It must be a 400, nothing called or stored.
func TestBindMalformedQueryIs400(t *testing.T) {
	b := newBindEnv(t)
	addr := strings.TrimPrefix(b.srv.URL, "http://")
	for i, target := range []string{
		"/orders/1/refund?dry_run=true;",
		"/orders/1/refund?dry_run=tru%e",
		"/orders/1/refund?dry_run=true&tag=a;b",
		"/orders/1/refund?%zz=1&dry_run=true",
	} {
		status, body := rawRequest(t, addr, "POST", target, "Idempotency-Key", fmt.Sprintf("malformed-%d", i), "Content-Type", "application/json")
		if status != http.StatusBadRequest || !strings.Contains(body, "query") {
			t.Errorf("%s: %d %s, want 400 naming the query", target, status, body)
		}
	}
	if n := b.calls.Load(); n != 0 {
		t.Fatalf("function called %d times with a query it could not read", n)
	}
	if n := b.e.keys(); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
	// A type that binds no query parameter keeps ignoring the query, as before.
	e := b.e
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /charge", idem.Handle(e.engine(), idem.Endpoint{Scope: "t.charge", Route: "POST /charge"}, e.charge))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/charge?x=1;y=2", strings.NewReader(`{"order":"o","amount":1}`))
	req.Header.Set("Idempotency-Key", "unbound")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("unbound malformed query: %d, want 200", resp.StatusCode)
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("charge called %d times, want 1", n)
	}
}

// panicID is a TextUnmarshaler with a bug: it panics on some input.
type panicID string

func (p *panicID) UnmarshalText(b []byte) error {
	if string(b) == "boom" {
		var m map[string]int
		m["x"]++ // nil map write: a real bug, a runtime panic
	}
	*p = panicID(b)
	return nil
}

type panicReq struct {
	ID panicID `path:"id"`
}

// A TextUnmarshaler that panics on the client's value made net/http drop the
// connection (no response; a retrying client tried again, in vain). It is a
// 400 naming the parameter (the same value always panics: retrying is
// useless), logged at error level with the stack for the operator; the
// server keeps serving.
func TestBindUnmarshalTextPanicIs400(t *testing.T) {
	e := newEnv(t)
	var logs syncBuffer
	e.cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	var calls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx, req panicReq) (string, error) {
		calls.Add(1)
		return string(req.ID), nil
	}
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /p/{id}", idem.Handle(e.engine(), idem.Endpoint{Scope: "t.panic", Route: "POST /p/{id}"}, fn))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "http://")
	status, body := rawRequest(t, addr, "POST", "/p/boom", "Idempotency-Key", "k1")
	if status != http.StatusBadRequest {
		t.Fatalf("panicking UnmarshalText: %d %s, want 400", status, body)
	}
	var p struct{ Detail string }
	if err := json.Unmarshal([]byte(body), &p); err != nil || !strings.HasPrefix(p.Detail, "path parameter id:") {
		t.Fatalf("detail %q (%v), want it to name path parameter id", p.Detail, err)
	}
	if strings.Contains(p.Detail, "nil map") {
		t.Fatalf("detail %q leaks the panic value to the client", p.Detail)
	}
	if !strings.Contains(logs.String(), "nil map") || !strings.Contains(logs.String(), "UnmarshalText") {
		t.Fatalf("panic not logged with its value: %q", logs.String())
	}
	if calls.Load() != 0 || e.keys() != 0 {
		t.Fatalf("calls %d, keys %d after a refused value", calls.Load(), e.keys())
	}
	if status, body := rawRequest(t, addr, "POST", "/p/fine", "Idempotency-Key", "k2"); status != http.StatusOK {
		t.Fatalf("after the panic: %d %s", status, body)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An absent or empty bound value is the field's zero value; the same value
// spelled out (X-Client-Version: 0, ?dry_run=false, X-Trace: 00000000) gives
// the function exactly the same request, so the same key replays. It was a
// 422 "different request": absent encoded as no value, 0 as one.
func TestBindAbsentEqualsExplicitZero(t *testing.T) {
	b := newBindEnv(t)
	first := b.send(t, "POST", "/orders/1/refund", "zero", `{"amount":1}`)
	if first.status != http.StatusOK {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	for _, c := range []struct {
		target string
		header []string
	}{
		{"/orders/1/refund?dry_run=false", nil},
		{"/orders/1/refund?dry_run=0&dry_run_unbound=1", nil},
		{"/orders/1/refund?dry_run=", nil},
		{"/orders/1/refund", []string{"X-Client-Version", "0"}},
		{"/orders/1/refund", []string{"X-Client-Version", "000"}},
		{"/orders/1/refund", []string{"X-Trace", "00000000"}},
	} {
		r := b.send(t, "POST", c.target, "zero", `{"amount":1}`, c.header...)
		if r.status != http.StatusOK || r.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s %v: %d %s, want the stored response replayed", c.target, c.header, r.status, r.body)
		}
	}
	// A value that is not zero is still another request.
	r := b.send(t, "POST", "/orders/1/refund", "zero", `{"amount":1}`, "X-Client-Version", "1")
	wantProblem(t, r, http.StatusUnprocessableEntity)
	if n := b.calls.Load(); n != 1 {
		t.Fatalf("function called %d times, want 1", n)
	}
}
