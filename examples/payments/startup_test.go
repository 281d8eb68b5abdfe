package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// Start-up of the real service binary (issue 9.9, 9.10): every start-up
// error is a clear message and a non-zero exit within seconds, SIGTERM
// during start-up ends it, and replicas starting together all come up.

// exitResult is how a child ended.
type exitResult struct {
	code   int
	stderr string
}

// runUntilExit runs `payments serve` with env; if sigterm is positive it
// sends SIGTERM after that long. It fails the test if the process is still
// running after limit (the old code hung forever).
func runUntilExit(t *testing.T, limit, sigterm time.Duration, env ...string) exitResult {
	t.Helper()
	return runServe(t, limit, sigterm, "", env...)
}

// runUntilExitAfter is runUntilExit sending SIGTERM once the process has
// written line to stderr (if it does: one that exits first is not sent any).
func runUntilExitAfter(t *testing.T, limit time.Duration, line string, env ...string) exitResult {
	t.Helper()
	return runServe(t, limit, 0, line, env...)
}

func runServe(t *testing.T, limit, sigterm time.Duration, sigtermOn string, env ...string) exitResult {
	t.Helper()
	cmd := exec.Command(buildCrashBinary(t), "serve")
	cmd.Env = append(os.Environ(), append([]string{"ADDR=127.0.0.1:0", "KAFKA_EMBEDDED_ADDR=127.0.0.1:0"}, env...)...)
	stderr := &watchedBuffer{want: sigtermOn, seen: make(chan struct{})}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	if sigterm > 0 {
		time.AfterFunc(sigterm, func() { _ = cmd.Process.Signal(syscall.SIGTERM) })
	}
	if sigtermOn != "" {
		go func() {
			select {
			case <-stderr.seen:
				_ = cmd.Process.Signal(syscall.SIGTERM)
			case <-exited:
			}
		}()
	}
	select {
	case <-exited:
	case <-time.After(limit):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("payments serve still running after %v:\n%s", limit, stderr.String())
	}
	return exitResult{code: cmd.ProcessState.ExitCode(), stderr: stderr.String()}
}

// watchedBuffer is a process's stderr: it keeps what was written and
// closes seen once that holds want (if want is set).
type watchedBuffer struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
	once sync.Once
}

func (w *watchedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, err := w.buf.Write(p)
	if w.want != "" && strings.Contains(w.buf.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return n, err
}

func (w *watchedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// blackhole is a TCP server that accepts connections and never answers: a
// database host that is up but hung.
func blackhole(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return "postgres://postgres@" + ln.Addr().String() + "/test?sslmode=disable"
}

// The service's own schema fails (an enum type already named charges): the old
// open() closed the pool while holding a connection and hung forever.
func TestStartupSchemaErrorExits(t *testing.T) {
	t.Parallel()
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pgtest.Exec(t, pool, `CREATE TYPE charges AS ENUM ('x')`)
	r := runUntilExit(t, 30*time.Second, 0, "DATABASE_URL="+url)
	if r.code != 1 || !strings.Contains(r.stderr, "create payments tables") {
		t.Fatalf("exit %d, stderr:\n%s\nwant exit 1 and the failing step", r.code, r.stderr)
	}
}

// A database host that accepts and never answers: exit 1 naming
// STARTUP_TIMEOUT once it passes.
func TestStartupUnresponsiveDatabaseExits(t *testing.T) {
	t.Parallel()
	r := runUntilExit(t, 30*time.Second, 0, "DATABASE_URL="+blackhole(t), "STARTUP_TIMEOUT=1s")
	if r.code != 1 || !strings.Contains(r.stderr, "STARTUP_TIMEOUT") {
		t.Fatalf("exit %d, stderr:\n%s\nwant exit 1 naming STARTUP_TIMEOUT", r.code, r.stderr)
	}
}

// SIGTERM while start-up waits for the database ends the process.
func TestSigtermDuringStartupExits(t *testing.T) {
	t.Parallel()
	r := runUntilExit(t, 30*time.Second, 500*time.Millisecond, "DATABASE_URL="+blackhole(t), "STARTUP_TIMEOUT=10m")
	if r.code == 0 || !strings.Contains(r.stderr, "interrupted") {
		t.Fatalf("exit %d, stderr:\n%s\nwant a non-zero exit saying start-up was interrupted", r.code, r.stderr)
	}
}

// Replicas starting together on a fresh schema all come up: idemgen's
// tables and the service's own are created under advisory locks (the
// service's CREATE TABLE IF NOT EXISTS alone raced on
// pg_type_typname_nsp_index).
func TestReplicasStartTogether(t *testing.T) {
	t.Parallel()
	for round := 0; round < 2; round++ {
		url := pgtest.Schema(t)
		const n = 6
		results := make([]exitResult, n)
		var wg sync.WaitGroup
		for i := range results {
			wg.Add(1)
			// SIGTERM once it has started (it says it listens): a clean
			// start-up then exits 0; a failed one exits 1 on its own. (A
			// SIGTERM 3s after the start bet that six replicas come up
			// within 3s on a loaded machine; one that had not was
			// interrupted during start-up and exited 1.)
			go func() {
				defer wg.Done()
				results[i] = runUntilExitAfter(t, 60*time.Second, "payments listening", "DATABASE_URL="+url)
			}()
		}
		wg.Wait()
		for i, r := range results {
			if r.code != 0 || !strings.Contains(r.stderr, "payments listening") {
				t.Fatalf("round %d, replica %d: exit %d:\n%s", round, i, r.code, r.stderr)
			}
		}
	}
}

// A wrong method on the generated RegisterIdemRoutes' route is a 405
// problem+json with Allow, like every other error (ServeMux's own is
// text/plain).
func TestGeneratedRouteWrongMethod(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	mux, err := newMux(pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/payments")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var p struct {
		Status int `json:"status"`
	}
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Content-Type") != "application/problem+json" ||
		resp.Header.Get("Allow") != "POST" || json.Unmarshal(body, &p) != nil || p.Status != 405 {
		t.Fatalf("GET /payments: %d %q Allow %q: %s", resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get("Allow"), body)
	}
}
