package faultproxy_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/internal/faultproxy"
)

// echoServer accepts connections and echoes them line by line until the test
// ends; accepted counts the connections it saw.
func echoServer(t *testing.T) (addr string, accepted *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted = new(atomic.Int32)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), accepted
}

type client struct {
	net.Conn
	r *bufio.Reader
}

func dial(t *testing.T, addr string) *client {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &client{c, bufio.NewReader(c)}
}

// roundTrip sends a line and reads the echo, giving up after timeout.
func (c *client) roundTrip(line string, timeout time.Duration) (string, error) {
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return "", err
	}
	s, err := c.r.ReadString('\n')
	if err != nil {
		return "", err
	}
	return s[:len(s)-1], nil
}

func mustEcho(t *testing.T, c *client) {
	t.Helper()
	if got, err := c.roundTrip("ping", 2*time.Second); err != nil || got != "ping" {
		t.Fatalf("round trip: got %q, %v; want ping", got, err)
	}
}

// mustClosed checks that the connection was closed by the proxy: a read
// ends with EOF or reset, not a timeout.
func mustClosed(t *testing.T, c *client) {
	t.Helper()
	_, err := c.roundTrip("ping", 2*time.Second)
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("round trip on a cut connection: %v; want EOF or reset", err)
	}
}

func mustSilent(t *testing.T, c *client) {
	t.Helper()
	if got, err := c.roundTrip("ping", 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("round trip in a blackhole: got %q, %v; want a timeout", got, err)
	}
}

func TestForwardAndCut(t *testing.T) {
	target, _ := echoServer(t)
	p := faultproxy.New(t, target)
	if p.Target() != target {
		t.Errorf("Target() = %q, want %q", p.Target(), target)
	}
	c := dial(t, p.Addr())
	mustEcho(t, c)
	if n := p.Conns(); n != 1 {
		t.Errorf("Conns() = %d, want 1", n)
	}
	p.Cut()
	if n := p.Conns(); n != 0 {
		t.Errorf("Conns() after Cut = %d, want 0", n)
	}
	mustClosed(t, c)
	mustEcho(t, dial(t, p.Addr())) // Cut is not Down
}

func TestDown(t *testing.T) {
	target, _ := echoServer(t)
	p := faultproxy.New(t, target)
	c := dial(t, p.Addr())
	mustEcho(t, c)
	p.Down()
	mustClosed(t, c)
	start := time.Now()
	// The reset can arrive before or after the dial completes.
	if nc, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		t.Cleanup(func() { nc.Close() })
		mustClosed(t, &client{nc, bufio.NewReader(nc)})
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("a new connection to a down proxy took %v to fail; want fast", d)
	}
	p.Restore()
	mustEcho(t, dial(t, p.Addr()))
}

func TestBlackhole(t *testing.T) {
	target, accepted := echoServer(t)
	p := faultproxy.New(t, target)
	old := dial(t, p.Addr())
	mustEcho(t, old)
	p.Blackhole()
	mustSilent(t, old)
	held := dial(t, p.Addr()) // accepted, but never reaches the target
	mustSilent(t, held)
	if n := p.Conns(); n != 2 {
		t.Errorf("Conns() in a blackhole = %d, want 2 (connections stay open)", n)
	}
	if n := accepted.Load(); n != 1 {
		t.Errorf("target accepted %d connections, want 1", n)
	}
	p.Restore()
	// The dropped bytes are gone, so the connections from the partition
	// are cut rather than resumed.
	mustClosed(t, old)
	mustClosed(t, held)
	mustEcho(t, dial(t, p.Addr()))
}

func TestLatency(t *testing.T) {
	target, _ := echoServer(t)
	p := faultproxy.New(t, target)
	c := dial(t, p.Addr())
	mustEcho(t, c)
	const d = 100 * time.Millisecond
	p.Latency(d)
	start := time.Now()
	mustEcho(t, c)
	if rtt := time.Since(start); rtt < 2*d {
		t.Errorf("round trip with latency %v took %v; want at least %v", d, rtt, 2*d)
	}
	p.Restore() // removes latency
	// Five round trips, under 5×2d together: with the latency still on they
	// take at least that; without it a single one delayed by a loaded
	// machine (one round trip against 2d = 200ms) does not fail the test.
	const n = 5
	start = time.Now()
	for range n {
		mustEcho(t, c)
	}
	if rtt := time.Since(start); rtt >= n*2*d {
		t.Errorf("%d round trips after Restore took %v; want under %v", n, rtt, n*2*d)
	}
}

// What the target sends under HoldReplies arrives after ReleaseReplies,
// not before and not never (a blackhole drops it).
func TestHoldReplies(t *testing.T) {
	target, _ := echoServer(t)
	p := faultproxy.New(t, target)
	c := dial(t, p.Addr())
	mustEcho(t, c)
	p.HoldReplies()
	mustSilent(t, c) // sent "ping"; its echo is held
	p.ReleaseReplies()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if got, err := c.r.ReadString('\n'); err != nil || got != "ping\n" {
		t.Fatalf("after ReleaseReplies: got %q, %v; want the held ping", got, err)
	}
	mustEcho(t, c)
}

// PreciseLatency holds each chunk for its delay (each way), and Latency
// after it is a timer's again (Close interrupts it: TestClose).
func TestPreciseLatency(t *testing.T) {
	target, _ := echoServer(t)
	p := faultproxy.New(t, target)
	c := dial(t, p.Addr())
	mustEcho(t, c)
	const d = 20 * time.Millisecond
	p.PreciseLatency(d)
	start := time.Now()
	mustEcho(t, c)
	if rtt := time.Since(start); rtt < 2*d {
		t.Errorf("round trip with precise latency %v took %v; want at least %v", d, rtt, 2*d)
	}
	p.Latency(time.Hour)
	_, _ = io.WriteString(c, "stuck\n")
	done := make(chan error)
	go func() { done <- p.Close() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung: Latency after PreciseLatency is not a timer's")
	}
}

func TestClose(t *testing.T) {
	target, _ := echoServer(t)
	p, err := faultproxy.Start(target)
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	mustEcho(t, c)
	p.Latency(time.Hour) // Close must not wait for a sleeping chunk
	_, _ = io.WriteString(c, "stuck\n")
	done := make(chan error)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung")
	}
	mustClosed(t, c)
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if c, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		c.Close()
		t.Error("dial after Close succeeded")
	}
}

func TestPostgresURL(t *testing.T) {
	p := faultproxy.New(t, "127.0.0.1:1")
	for _, tc := range []struct{ in, target, rewritten string }{
		{
			"postgres://postgres@127.0.0.1:5432/test?sslmode=disable&search_path=t_1",
			"127.0.0.1:5432",
			"postgres://postgres@" + p.Addr() + "/test?sslmode=disable&search_path=t_1",
		},
		{
			"postgresql://u:pw@db.example/x",
			"db.example:5432",
			"postgresql://u:pw@" + p.Addr() + "/x",
		},
		{"postgres://[::1]:6000/x", "[::1]:6000", "postgres://" + p.Addr() + "/x"},
		{"postgres://h1:5433,h2:5434/x", "h1:5433", "postgres://" + p.Addr() + "/x"},
		{"postgres:///x?host=/tmp&sslmode=disable", "localhost:5432", "postgres://" + p.Addr() + "/x?sslmode=disable"},
	} {
		if got := faultproxy.PostgresTarget(tc.in); got != tc.target {
			t.Errorf("PostgresTarget(%q) = %q, want %q", tc.in, got, tc.target)
		}
		if got := p.RewriteURL(tc.in); got != tc.rewritten {
			t.Errorf("RewriteURL(%q) = %q, want %q", tc.in, got, tc.rewritten)
		}
	}
}

// pgURL is the test server, as in internal/pgtest (not imported, to keep
// this package free of the rest of the repository).
func pgURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

func pgConnect(t *testing.T, u string, timeout time.Duration) (*pgx.Conn, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := pgx.Connect(ctx, u)
	if err == nil {
		t.Cleanup(func() { c.Close(context.Background()) })
	}
	return c, err
}

func pgSelect(c *pgx.Conn, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var n int
	return c.QueryRow(ctx, "SELECT 1").Scan(&n)
}

func TestPostgres(t *testing.T) {
	p := faultproxy.New(t, faultproxy.PostgresTarget(pgURL()))
	u := p.RewriteURL(pgURL())
	mustConnect := func() *pgx.Conn {
		t.Helper()
		c, err := pgConnect(t, u, 5*time.Second)
		if err != nil {
			t.Fatalf("connect through the proxy: %v", err)
		}
		if err := pgSelect(c, 5*time.Second); err != nil {
			t.Fatalf("query through the proxy: %v", err)
		}
		return c
	}

	c := mustConnect()
	if n := p.Conns(); n != 1 {
		t.Errorf("Conns() = %d, want 1", n)
	}

	t.Run("Cut", func(t *testing.T) {
		p.Cut()
		err := pgSelect(c, 5*time.Second)
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("query after Cut: %v; want a connection error", err)
		}
		c = mustConnect()
	})

	t.Run("Down", func(t *testing.T) {
		p.Down()
		if err := pgSelect(c, 5*time.Second); err == nil {
			t.Error("query on a connection from before Down succeeded")
		}
		start := time.Now()
		if _, err := pgConnect(t, u, 5*time.Second); err == nil {
			t.Fatal("connect while Down succeeded")
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("connect while Down took %v to fail; want fast", d)
		}
		p.Restore()
		c = mustConnect()
	})

	t.Run("Blackhole", func(t *testing.T) {
		p.Blackhole()
		start := time.Now()
		err := pgSelect(c, 500*time.Millisecond)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("query in a blackhole: %v; want context.DeadlineExceeded", err)
		}
		if d := time.Since(start); d < 500*time.Millisecond {
			t.Errorf("query in a blackhole failed after %v, before its deadline", d)
		}
		start = time.Now()
		if _, err := pgConnect(t, u, 500*time.Millisecond); err == nil {
			t.Error("connect in a blackhole succeeded")
		}
		if d := time.Since(start); d < 500*time.Millisecond {
			t.Errorf("connect in a blackhole failed after %v, before its timeout", d)
		}
		p.Restore()
		c = mustConnect()
	})

	t.Run("Latency", func(t *testing.T) {
		const d = 50 * time.Millisecond
		p.Latency(d)
		start := time.Now()
		if err := pgSelect(c, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		if rtt := time.Since(start); rtt < 2*d {
			t.Errorf("query with latency %v took %v; want at least %v", d, rtt, 2*d)
		}
		p.Latency(0)
	})
}
