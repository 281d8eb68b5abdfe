package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// Faults an outside reviewer threw at the provider call (see
// notes/clientfix.md).

// stallingProvider answers every call with a 201 whose headers promise a
// body it never finishes sending, and keeps the connection open until the
// test ends.
func stallingProvider(t *testing.T) (url string, calls <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	seen := make(chan struct{}, 16)
	t.Cleanup(func() { close(done); ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				req, err := http.ReadRequest(bufio.NewReader(conn))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				seen <- struct{}{}
				_, _ = io.WriteString(conn, "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"id\":")
				<-done
			}()
		}
	}()
	return "http://" + ln.Addr().String(), seen
}

// A provider that sends its 201's headers and stalls the body: no response
// header timeout covers a body, and the service must not hold its
// transaction (or a consumer its partition) for as long as the provider
// stalls. The call is bounded (providerCallTimeout): the service answers
// 502, stores nothing and frees its connection.
func TestChargeProviderStallsItsAnswer(t *testing.T) {
	old := providerCallTimeout
	providerCallTimeout = time.Second
	t.Cleanup(func() { providerCallTimeout = old })
	url := pgtest.Schema(t)
	stalling, calls := stallingProvider(t)
	srv, pool := serviceFor(t, url, stalling)
	addr := strings.TrimPrefix(srv.URL, "http://")

	// charge's own 30s client timeout only ends a failing run.
	status, body, _, err := charge(addr, "key-stall", "order-stall")
	if err != nil || status != http.StatusBadGateway {
		t.Fatalf("provider stalls its answer: %d %s %v; want 502 once the call's time is up", status, body, err)
	}
	if len(calls) != 1 {
		t.Fatalf("the provider saw %d calls, want 1 (a 201 is not retried)", len(calls))
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`) + pgtest.Count(t, pool, `SELECT count(*) FROM charges`); n != 0 {
		t.Fatalf("%d rows stored, want 0", n)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still held", n)
	}
}

// The provider applies the charge, and its 201 reaches the service cut short
// (Content-Length promises more, the connection closes): the service cannot
// read the charge, answers 502 and stores nothing; the client's retry
// reaches the provider with the same key, which replays the charge. One
// charge on each side, two calls.
func TestChargeProviderAnswerTruncated(t *testing.T) {
	url := pgtest.Schema(t)
	p := providerFor(t, url)
	// In front of the real provider: forwards the call, then truncates the
	// answer.
	cutter := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fwd, _ := http.NewRequestWithContext(r.Context(), r.Method, p.url+r.URL.Path, r.Body)
		fwd.Header = r.Header.Clone()
		resp, err := http.DefaultTransport.RoundTrip(fwd)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		conn, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", resp.StatusCode, http.StatusText(resp.StatusCode), len(b))
		buf.Write(b[:len(b)/2])
		buf.Flush()
	}))
	defer cutter.Close()
	srv, pool := serviceFor(t, url, cutter.URL)
	addr := strings.TrimPrefix(srv.URL, "http://")

	status, body, _, err := charge(addr, "key-cut", "order-cut")
	if err != nil || status != http.StatusBadGateway {
		t.Fatalf("truncated provider answer: %d %s %v; want 502", status, body, err)
	}
	wantCounts(t, p, pool, "order-cut", 1, 1, 0)
	useProvider(p.url)
	status, body, _, err = charge(addr, "key-cut", "order-cut")
	if err != nil || status != http.StatusCreated {
		t.Fatalf("retry: %d %s %v", status, body, err)
	}
	wantCounts(t, p, pool, "order-cut", 2, 1, 1)
}

// The service is SIGKILLed after the provider charged, three times in a row
// (the client retries against each restarted, again crashing, service),
// then runs clean: every run sent the same key, so the provider counts a
// call per run and one charge, and the service records one.
func TestCrashRepeatedlyAfterProviderCall(t *testing.T) {
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	prov := providerFor(t, url)
	const order, key, kills = "order-rk", "key-rk", 3
	for i := 1; i <= kills; i++ {
		c := startChild(t, url, "IDEM_CRASH_AT=charge.after-provider-call")
		if status, body, _, err := charge(c.addr, key, order); err == nil {
			t.Fatalf("kill %d: the killed service answered %d %s", i, status, body)
		}
		c.waitExit(t)
		if !c.killedBySIGKILL() {
			t.Fatalf("kill %d: child ended %v, want SIGKILL", i, c.cmd.ProcessState)
		}
		wantCounts(t, prov, pool, order, int64(i), 1, 0)
	}
	c := startChild(t, url)
	status, body, _, err := charge(c.addr, key, order)
	if err != nil || status != http.StatusCreated {
		t.Fatalf("clean run: %d %s %v", status, body, err)
	}
	wantCounts(t, prov, pool, order, kills+1, 1, 1)
	c.stop(t)
}

// `payments provider` on a port another process holds: it exits at once
// with an error naming the address, it does not hang or serve elsewhere.
func TestProviderStartPortTaken(t *testing.T) {
	url := pgtest.Schema(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cmd := exec.Command(buildCrashBinary(t), "provider")
	cmd.Env = append(cmd.Environ(), "DATABASE_URL="+url, "PROVIDER_ADDR="+taken.Addr().String())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		if err == nil || !strings.Contains(stderr.String(), "address already in use") || !strings.Contains(stderr.String(), taken.Addr().String()) {
			t.Fatalf("exit %v, stderr:\n%s\nwant a failure naming the taken address", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("the provider did not exit with its port taken:\n%s", stderr.String())
	}
}
