package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
)

// The crash tests run the real service as a child process built with
// -tags idemcrash, kill it at named points inside the idempotent
// transaction, restart it and retry like a client would. Whatever the point:
// the order is charged exactly once and the client ends with one receipt.

var (
	binaryOnce sync.Once
	binary     string
	binaryErr  error
	binaryDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binaryDir != "" {
		os.RemoveAll(binaryDir)
	}
	os.Exit(code)
}

// buildCrashBinary builds the service with its crash points, once per run.
func buildCrashBinary(t *testing.T) string {
	t.Helper()
	binaryOnce.Do(func() {
		if binaryDir, binaryErr = os.MkdirTemp("", "payments-crash-"); binaryErr != nil {
			return
		}
		binary = filepath.Join(binaryDir, "payments")
		out, err := exec.Command("go", "build", "-tags", "idemcrash", "-o", binary, ".").CombinedOutput()
		if err != nil {
			binaryErr = fmt.Errorf("build: %v\n%s", err, out)
		}
	})
	if binaryErr != nil {
		t.Fatal(binaryErr)
	}
	return binary
}

type child struct {
	cmd    *exec.Cmd
	addr   string
	exited chan struct{}

	mu    sync.Mutex
	lines []string // stderr, for log assertions
}

var (
	listening = regexp.MustCompile(`payments listening.*addr=(\S+)`)
	consuming = regexp.MustCompile(`payments consuming`)
	leading   = regexp.MustCompile(`payments relay leading`)
)

// startChild runs `payments serve` on a free port with extra env. Its
// payment provider is the test's in-process one on the same schema
// (providerFor), unless env sets PROVIDER_URL.
func startChild(t *testing.T, dbURL string, env ...string) *child {
	t.Helper()
	base := []string{"DATABASE_URL=" + dbURL, "ADDR=127.0.0.1:0", "NOT_READY_DELAY=0", "KAFKA_EMBEDDED_ADDR=127.0.0.1:0"}
	if !slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, "PROVIDER_URL=") }) {
		base = append(base, "PROVIDER_URL="+providerFor(t, dbURL).url)
	}
	return startProcess(t, "serve", listening, append(base, env...)...)
}

// startProcess runs `payments <subcmd>` and waits for a stderr line matching
// ready (its first submatch, if any, becomes c.addr).
func startProcess(t *testing.T, subcmd string, ready *regexp.Regexp, env ...string) *child {
	t.Helper()
	cmd := exec.Command(buildCrashBinary(t), subcmd)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, exited: make(chan struct{})}
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			c.mu.Lock()
			c.lines = append(c.lines, sc.Text())
			c.mu.Unlock()
			if m := ready.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case found <- append(m, "")[1]:
				default:
				}
			}
		}
		_ = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-c.exited })
	select {
	case c.addr = <-found:
	case <-c.exited:
		select {
		case c.addr = <-found: // ready, then gone (a crash test's kill)
		default:
			t.Fatalf("payments %s exited before it was ready:\n%s", subcmd, c.log())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("payments %s not ready in 30s:\n%s", subcmd, c.log())
	}
	return c
}

func (c *child) log() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.lines, "\n")
}

// waitLog waits for a stderr line matching re.
func (c *child) waitLog(t *testing.T, re *regexp.Regexp) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if re.MatchString(c.log()) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no log line matching %v:\n%s", re, c.log())
}

func (c *child) waitExit(t *testing.T) {
	t.Helper()
	select {
	case <-c.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("child did not exit")
	}
}

// killedBySIGKILL reports whether the child died of SIGKILL (a crash point).
func (c *child) killedBySIGKILL() bool {
	ws, ok := c.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// stop sends SIGTERM and waits for a clean exit.
func (c *child) stop(t *testing.T) {
	t.Helper()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitExit(t)
	if !c.cmd.ProcessState.Success() {
		t.Fatalf("SIGTERM: child exited %v, want a clean exit:\n%s", c.cmd.ProcessState, c.log())
	}
}

func charge(addr, key, order string) (int, string, http.Header, error) {
	body := fmt.Sprintf(`{"order_id":%q,"amount":1000,"currency":"EUR"}`, order)
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/payments", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header, nil
}

func counts(t *testing.T, pool *pgxpool.Pool, order string) (charges, keys int64) {
	t.Helper()
	return pgtest.Count(t, pool, `SELECT count(*) FROM charges WHERE order_id = $1`, order),
		pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`)
}

func TestCrashAtEveryPoint(t *testing.T) {
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	points := []struct {
		name      string
		committed bool // the kill comes after the commit
		charged   bool // the kill comes after the provider charged
	}{
		{"http.after-claim", false, false},
		{"charge.after-provider-call", false, true},
		{"http.after-call", false, true},
		{"http.before-commit", false, true},
		{"http.after-commit", true, true},
	}
	for i, p := range points {
		t.Run(p.name, func(t *testing.T) {
			order, key := fmt.Sprintf("order-%d", i), fmt.Sprintf("key-%d", i)
			c := startChild(t, url, "IDEM_CRASH_AT="+p.name)
			if status, body, _, err := charge(c.addr, key, order); err == nil {
				t.Fatalf("the killed service answered: %d %s", status, body)
			}
			c.waitExit(t)
			if !c.killedBySIGKILL() {
				t.Fatalf("child ended with %v, want SIGKILL at %s", c.cmd.ProcessState, p.name)
			}
			charges, _ := counts(t, pool, order)
			if want := map[bool]int64{false: 0, true: 1}[p.committed]; charges != want {
				t.Fatalf("after the kill: %d charges, want %d", charges, want)
			}
			prov := providerFor(t, url)
			charged := map[bool]int64{false: 0, true: 1}[p.charged]
			wantCounts(t, prov, pool, order, charged, charged, charges)

			// The client retries against a restarted service.
			c2 := startChild(t, url)
			status, body, header, err := charge(c2.addr, key, order)
			if err != nil || status != http.StatusCreated {
				t.Fatalf("retry: %d %s %v", status, body, err)
			}
			if replayed := header.Get("Idempotent-Replayed") == "true"; replayed != p.committed {
				t.Fatalf("retry replayed=%v, want %v", replayed, p.committed)
			}
			again, body2, _, err := charge(c2.addr, key, order)
			if err != nil || again != http.StatusCreated || body2 != body {
				t.Fatalf("second retry: %d %s, want the same receipt %s", again, body2, body)
			}
			if charges, _ := counts(t, pool, order); charges != 1 {
				t.Fatalf("after retries: %d charges, want exactly 1", charges)
			}
			// The seed's double protection: the provider charged once, with
			// one more call only if the retry ran the operation again.
			calls := charged
			if !p.committed {
				calls++
			}
			wantCounts(t, prov, pool, order, calls, 1, 1)
			c2.stop(t)
		})
	}
}

// SIGTERM while a request hangs past the drain deadline (a stalled
// downstream call after the charge's INSERT): shutdown cancels it, the
// transaction rolls back, nothing is stored; the retry charges once.
func TestSigtermPastDrainDeadline(t *testing.T) {
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// The child's sessions carry an application_name of their own: the
	// database is shared with other tests (and other test runs), whose
	// sessions are idle in transaction now and then too.
	app := "sigterm-drain-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	c := startChild(t, withAppName(url, app), "IDEM_STALL_AT=http.after-call", "DRAIN_TIMEOUT=500ms")
	type answer struct {
		status int
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		status, _, _, err := charge(c.addr, "key-stall", "order-stall")
		done <- answer{status, err}
	}()
	// Wait until the charge's INSERT is in the open transaction (whose last
	// statement, at http.after-call, is the function's outbox INSERT).
	deadline := time.Now().Add(10 * time.Second)
	for pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND application_name = $1
		AND query LIKE '%name: EnqueueOutbox%'`, app) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("request never reached the stall point")
		}
		time.Sleep(20 * time.Millisecond)
	}
	start := time.Now()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	c.waitExit(t)
	if took := time.Since(start); took < 500*time.Millisecond {
		t.Fatalf("exited after %v, before the drain deadline", took)
	}
	if a := <-done; a.err == nil && a.status < 500 {
		t.Fatalf("the cancelled request answered %d, want a 5xx or a cut connection", a.status)
	}
	if charges, keys := counts(t, pool, "order-stall"); charges != 0 || keys != 0 {
		t.Fatalf("after the cancelled request: %d charges, %d keys; want 0, 0", charges, keys)
	}
	c2 := startChild(t, url)
	if status, body, _, err := charge(c2.addr, "key-stall", "order-stall"); err != nil || status != http.StatusCreated {
		t.Fatalf("retry: %d %s %v", status, body, err)
	}
	if charges, _ := counts(t, pool, "order-stall"); charges != 1 {
		t.Fatalf("%d charges, want 1", charges)
	}
}
