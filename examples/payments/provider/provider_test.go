package provider

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// newTestServer runs the provider on a fresh schema.
func newTestServer(t *testing.T) (*Server, *httptest.Server) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), pgtest.Schema(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	s := New(pool, nil)
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	return s, srv
}

// rawCall sends bytes the Go client would refuse to send (a header value
// with invalid UTF-8) and returns the status and body.
func rawCall(t *testing.T, srv *httptest.Server, key, body string) (int, string) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /charges HTTP/1.1\r\nHost: provider\r\nIdempotency-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", key, len(body), body)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Bytes PostgreSQL refuses, or that JSON decoding would silently rewrite:
// invalid UTF-8 in the body (encoding/json turns it into U+FFFD, which would
// charge an order id the caller never sent), NUL (raw or escaped), and a key
// that is not visible ASCII. Each is 400 and charges nothing.
func TestProviderRefusesUnstorableBytes(t *testing.T) {
	s, srv := newTestServer(t)
	for _, c := range []struct{ name, key, body, order string }{
		{"invalid UTF-8 in order_id", "k-1", "{\"order_id\":\"o-1\xff\",\"amount\":100,\"currency\":\"EUR\"}", "o-1\ufffd"},
		{"invalid UTF-8 in currency", "k-2", "{\"order_id\":\"o-2\",\"amount\":100,\"currency\":\"E\xc3R\"}", "o-2"},
		{"raw NUL", "k-3", "{\"order_id\":\"o-3\x00\",\"amount\":100,\"currency\":\"EUR\"}", "o-3\x00"},
		{"escaped NUL", "k-4", `{"order_id":"o-4\u0000","amount":100,"currency":"EUR"}`, "o-4\x00"},
		{"key with invalid UTF-8", "k-5\xff", `{"order_id":"o-5","amount":100,"currency":"EUR"}`, "o-5"},
	} {
		status, body := rawCall(t, srv, c.key, c.body)
		if status != http.StatusBadRequest {
			t.Errorf("%s: %d %s, want 400", c.name, status, body)
		}
		for _, order := range []string{c.order, strings.ToValidUTF8(c.order, "\ufffd")} {
			if !strings.ContainsRune(order, 0) {
				if _, charges, err := s.Counts(context.Background(), order); err != nil || charges != 0 {
					t.Errorf("%s: %d charges for %q (%v), want 0", c.name, charges, order, err)
				}
			}
		}
	}
}
