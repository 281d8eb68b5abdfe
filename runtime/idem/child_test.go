package idem_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Child processes: the test binary re-runs itself with IDEM_TEST_CHILD set
// to serve an engine (for the readiness and SIGKILL tests) or to migrate
// (for concurrent start-ups), so those tests observe and kill a real process
// from outside it.
func TestMain(m *testing.M) {
	switch os.Getenv("IDEM_TEST_CHILD") {
	case "":
		os.Exit(m.Run())
	case "serve":
		err := childServe()
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	case "migrate":
		pool, err := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
		if err == nil {
			err = idem.Migrate(context.Background(), pool)
			pool.Close()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

// childServe serves POST /charges (an order "sleep" runs pg_sleep(60) in
// the function's transaction) and GET /readyz on a free port, printing
// "listening ADDR", until SIGTERM.
func childServe() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{NoConnCheck: os.Getenv("NO_CONN_CHECK") != ""})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	idem.HandleRoute(mux, "POST /charges", idem.Handle(engine, idem.Endpoint{Scope: "child", Route: "POST /charges"},
		func(ctx context.Context, tx pgx.Tx, req chargeReq) (receipt, error) {
			if req.Order == "sleep" {
				if _, err := tx.Exec(ctx, `SELECT pg_sleep(60)`); err != nil {
					return receipt{}, err
				}
			}
			return receipt{Order: req.Order}, nil
		}))
	ready := &idem.Readiness{}
	mux.Handle("GET /readyz", ready)
	delay, err := time.ParseDuration(os.Getenv("NOT_READY_DELAY"))
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Printf("listening %s\n", ln.Addr())
	// NOT_READY_DELAY=0 is the old behaviour (readiness and listener close
	// together), for checking that the readiness test fails without the delay.
	return idem.ServeHTTP(ctx, &http.Server{Handler: mux}, ln, idem.ServeConfig{Ready: ready, NotReadyDelay: delay, NoNotReadyDelay: delay == 0, Drain: 2 * time.Second})
}

type childProc struct {
	cmd    *exec.Cmd
	addr   string
	exited chan struct{}
	err    error // Wait's, once exited is closed
}

// startChildProc runs this test binary as a child in mode, with env.
func startChildProc(t *testing.T, mode string, env ...string) *childProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{"IDEM_TEST_CHILD=" + mode}, env...)...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &childProc{cmd: cmd, exited: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "listening "); ok {
				addr <- a
			}
		}
		c.err = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-c.exited })
	if mode == "serve" {
		select {
		case c.addr = <-addr:
		case <-c.exited:
			t.Fatalf("child exited before listening: %v", c.err)
		case <-time.After(30 * time.Second):
			t.Fatal("child not listening after 30s")
		}
	}
	return c
}

// withParam adds a query parameter to a connection URL.
func withParam(t *testing.T, dbURL, name, value string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(name, value)
	u.RawQuery = q.Encode()
	return u.String()
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// Issue 9.12: a replica SIGKILLed while its backend runs a long statement
// inside the idempotent transaction frees the key within
// client_connection_check_interval (1s by default): a retry on another
// replica runs, instead of waiting for the statement (60s) to end and
// answering 409.
func TestKilledReplicaFreesKeyMidStatement(t *testing.T) {
	t.Parallel()
	app := randomName("idemkill_")
	dbURL := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	c := startChildProc(t, "serve", "DATABASE_URL="+withParam(t, dbURL, "application_name", app), "NOT_READY_DELAY=1ms", "NO_CONN_CHECK="+os.Getenv("IDEM_TEST_NO_CONN_CHECK"))
	go func() {
		req, _ := http.NewRequest(http.MethodPost, "http://"+c.addr+"/charges", strings.NewReader(`{"order":"sleep"}`))
		req.Header.Set("Idempotency-Key", "k-killed")
		if resp, err := httpClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	sleeping := func() bool {
		return pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'active' AND query = 'SELECT pg_sleep(60)'`, app) == 1
	}
	waitFor(t, sleeping)
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-c.exited
	killed := time.Now()

	engine, err := idem.NewHTTP(idem.NewStore(pool), idem.HTTPConfig{})
	if err != nil {
		t.Fatal(err)
	}
	retry := serveReal(t, idem.Handle(engine, idem.Endpoint{Scope: "child", Wait: 10 * time.Second},
		func(context.Context, pgx.Tx, chargeReq) (receipt, error) { return receipt{Order: "retried"}, nil }))
	r := send(t, retry, "k-killed", `{"order":"retry"}`)
	if r.status != http.StatusOK {
		t.Fatalf("retry on another replica after the kill: %d %s", r.status, r.body)
	}
	t.Logf("key freed and retried %v after the SIGKILL", time.Since(killed).Round(10*time.Millisecond))
	if sleeping() {
		t.Fatal("the killed replica's statement is still running")
	}
}

// Issue 9.11: on SIGTERM readiness answers 503 for NotReadyDelay while the
// port still serves, as a probe from outside the process sees, and only then
// does the listener close; the process exits 0.
func TestReadinessFailsBeforeListenerCloses(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	delay := "1500ms"
	if d := os.Getenv("IDEM_TEST_NOT_READY_DELAY"); d != "" {
		delay = d // 0: the old behaviour, which this test must fail
	}
	c := startChildProc(t, "serve", "DATABASE_URL="+dbURL, "NOT_READY_DELAY="+delay)
	base := "http://" + c.addr
	// A probe as an orchestrator sends it: a new connection each time.
	probeClient := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	probe := func() (int, error) {
		resp, err := probeClient.Get(base + "/readyz")
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if code, err := probe(); code != http.StatusOK {
		t.Fatalf("probe before SIGTERM: %d %v", code, err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var saw503, servedWhileNotReady bool
	var once sync.Once
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("listener still open 20s after SIGTERM")
		}
		code, err := probe()
		if err != nil {
			var opErr *net.OpError
			if !errors.As(err, &opErr) && !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("probe: %v", err)
			}
			// Connection refused, or accepted into the backlog just as the
			// listener closed (EOF, reset): the listener is closed.
			break
		}
		if code == http.StatusServiceUnavailable {
			saw503 = true
			once.Do(func() {
				// Requests are still served meanwhile.
				r := send(t, base+"/charges", "k-late", `{"order":"late"}`)
				servedWhileNotReady = r.status == http.StatusOK
			})
		}
	}
	if !saw503 {
		t.Fatal("readiness never observed failing before the listener closed")
	}
	if !servedWhileNotReady {
		t.Fatal("a request while not ready was not served")
	}
	<-c.exited
	if c.err != nil {
		t.Fatalf("child exit: %v", c.err)
	}
}

// Issue 9.9: N processes migrating one fresh schema at once all succeed,
// and the schema is recorded as current.
func TestMigrateFromManyProcesses(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.Schema(t)
	if !migrateInChildren(t, dbURL, 6, 60*time.Second) {
		t.FailNow()
	}
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var digest string
	if err := pool.QueryRow(context.Background(), `SELECT digest FROM idem_schema_version`).Scan(&digest); err != nil || digest != idem.SchemaVersion() {
		t.Fatalf("schema version %q (%v), want %q", digest, err, idem.SchemaVersion())
	}
}

// Issue 9.9: Migrate on a current schema takes no lock a running request
// could block: with a request's transaction open on idem_keys it returns at
// once (the old CREATE INDEX IF NOT EXISTS waited for it, and new claims
// queued behind that).
func TestMigrateCurrentTakesNoLock(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	release := lockTable(t, pool, `INSERT INTO idem_keys (scope, principal, key, fingerprint, expires_at) VALUES ('s', '', 'in-flight', '', now() + interval '1 hour')`)
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate with a request in flight: %v", err)
	}
}

// migrateInChildren runs idem.Migrate on dbURL in n child processes at once
// and waits up to limit for each, reporting (t.Errorf) each that failed or
// is still running. It reports whether all of them succeeded.
func migrateInChildren(t *testing.T, dbURL string, n int, limit time.Duration) bool {
	t.Helper()
	children := make([]*childProc, n)
	for i := range children {
		children[i] = startChildProc(t, "migrate", "DATABASE_URL="+dbURL)
	}
	ok := true
	for i, c := range children {
		select {
		case <-c.exited:
			if c.err != nil {
				t.Errorf("migrating process %d: %v", i, c.err)
				ok = false
			}
		case <-time.After(limit):
			t.Errorf("migrating process %d still running after %v", i, limit)
			ok = false
		}
	}
	return ok
}

// outboxWriters starts n goroutines that insert outbox rows of default
// columns only (a previous schema's outbox and the current one both take
// them) as fast as they can, until the returned stop is called; stop waits
// for them and returns how many rows they inserted.
func outboxWriters(t *testing.T, pool *pgxpool.Pool, n int) (stop func() int64) {
	done := make(chan struct{})
	var inserted atomic.Int64
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				if _, err := pool.Exec(context.Background(), `INSERT INTO idem_outbox (topic, payload) VALUES ('t', '\x00')`); err != nil {
					t.Errorf("outbox insert during the upgrade: %v", err)
					return
				}
				inserted.Add(1)
			}
		})
	}
	return func() int64 {
		close(done)
		wg.Wait()
		return inserted.Load()
	}
}
