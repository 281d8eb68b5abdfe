package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/examples/payments/provider"
	"github.com/idemgen/idemgen/internal/pgtest"
)

// testProvider is the payment provider of one test: in the test process
// (so it outlives the service children the test kills), on its own port,
// storing in the provider_* tables of the test's schema.
type testProvider struct {
	*provider.Server
	url  string
	pool *pgxpool.Pool
}

var (
	providersMu sync.Mutex
	providers   = map[string]*testProvider{} // by database URL, while its test runs
)

// providerFor returns the test's provider on dbURL, starting it on first use.
func providerFor(t *testing.T, dbURL string) *testProvider {
	t.Helper()
	providersMu.Lock()
	defer providersMu.Unlock()
	if p := providers[dbURL]; p != nil {
		return p
	}
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	if err := provider.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &testProvider{Server: provider.New(pool, nil), url: "http://" + ln.Addr().String(), pool: pool}
	srv := &http.Server{Handler: p.Handler()}
	go func() { _ = srv.Serve(ln) }()
	providers[dbURL] = p
	t.Cleanup(func() {
		providersMu.Lock()
		delete(providers, dbURL)
		providersMu.Unlock()
		_ = srv.Close()
		pool.Close()
	})
	return p
}

// counts returns the provider's raw calls and applied charges for order.
func (p *testProvider) counts(t *testing.T, order string) (calls, charges int64) {
	t.Helper()
	calls, charges, err := p.Counts(context.Background(), order)
	if err != nil {
		t.Fatal(err)
	}
	return calls, charges
}

// wantCounts checks the seed's double protection for one order.
func wantCounts(t *testing.T, p *testProvider, pool *pgxpool.Pool, order string, wantCalls, wantProvider, wantOurs int64) {
	t.Helper()
	calls, charged := p.counts(t, order)
	ours := pgtest.Count(t, pool, `SELECT count(*) FROM charges WHERE order_id = $1`, order)
	if calls != wantCalls || charged != wantProvider || ours != wantOurs {
		t.Fatalf("%s: provider calls %d, provider charges %d, our charges %d; want %d, %d, %d",
			order, calls, charged, ours, wantCalls, wantProvider, wantOurs)
	}
}

func providerCall(t *testing.T, url, key, body string) (int, string, http.Header) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/charges", strings.NewReader(body))
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

// The provider on its own: one charge per key, however many calls, even
// concurrent ones; every call counted.
func TestProviderAppliesOncePerKey(t *testing.T) {
	url := pgtest.Schema(t)
	p := providerFor(t, url)
	body := `{"order_id":"p-1","amount":300,"currency":"EUR"}`
	const n = 16
	statuses := make([]int, n)
	bodies := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); statuses[i], bodies[i], _ = providerCall(t, p.url, "k-1", body) }()
	}
	wg.Wait()
	created := 0
	for i := range n {
		if statuses[i] == http.StatusCreated {
			created++
		} else if statuses[i] != http.StatusOK {
			t.Fatalf("call %d: %d %s", i, statuses[i], bodies[i])
		}
		if bodies[i] != bodies[0] {
			t.Fatalf("call %d answered %s, call 0 %s: want one charge", i, bodies[i], bodies[0])
		}
	}
	if created != 1 {
		t.Fatalf("%d calls answered 201, want 1 (the rest replay with 200)", created)
	}
	if status, _, h := providerCall(t, p.url, "k-1", body); status != http.StatusOK || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %v", status, h)
	}
	if status, _, _ := providerCall(t, p.url, "k-1", `{"order_id":"p-1","amount":999,"currency":"EUR"}`); status != http.StatusUnprocessableEntity {
		t.Fatalf("same key, another charge: %d, want 422", status)
	}
	if status, _, _ := providerCall(t, p.url, "", body); status != http.StatusBadRequest {
		t.Fatalf("no key: %d, want 400", status)
	}
	if calls, charges := p.counts(t, "p-1"); calls != n+3 || charges != 1 {
		t.Fatalf("%d calls, %d charges; want %d calls, 1 charge", calls, charges, n+3)
	}
}

var providerListening = regexp.MustCompile(`provider listening.*addr=(\S+)`)

// The provider process is SIGKILLed after it committed the charge and
// before its response reached the service ("provider.after-apply"). The
// service's client retries with the same key against the dead provider,
// gives up, and the service answers 502 with nothing stored. The client
// retries after the provider is back: the provider replays the charge it
// applied, the service records it once.
func TestProviderCrashAfterApply(t *testing.T) {
	url := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	counter := &testProvider{Server: provider.New(pool, nil)} // reads the provider's tables; serves nothing

	prov := startProcess(t, "provider", providerListening, "DATABASE_URL="+url, "PROVIDER_ADDR=127.0.0.1:0", "IDEM_CRASH_AT=provider.after-apply")
	svc := startChild(t, url, "PROVIDER_URL=http://"+prov.addr)
	const order, key = "order-pa", "key-pa"

	status, body, _, err := charge(svc.addr, key, order)
	if err != nil || status != http.StatusBadGateway {
		t.Fatalf("with the provider killed after applying: %d %s %v, want 502", status, body, err)
	}
	prov.waitExit(t)
	if !prov.killedBySIGKILL() {
		t.Fatalf("provider ended %v, want SIGKILL at provider.after-apply:\n%s", prov.cmd.ProcessState, prov.log())
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Fatalf("%d keys stored for a failed charge, want 0", n)
	}
	// Charged at the provider, not recorded by us: the split the seed warns about.
	wantCounts(t, counter, pool, order, 1, 1, 0)

	// The provider restarts on the same address; the client retries.
	prov2 := startProcess(t, "provider", providerListening, "DATABASE_URL="+url, "PROVIDER_ADDR="+prov.addr)
	status, body, _, err = charge(svc.addr, key, order)
	if err != nil || status != http.StatusCreated {
		t.Fatalf("retry: %d %s %v", status, body, err)
	}
	again, body2, _, err := charge(svc.addr, key, order)
	if err != nil || again != http.StatusCreated || body2 != body {
		t.Fatalf("second retry: %d %s, want the same receipt %s", again, body2, body)
	}
	// Two calls (the killed one and the retry), one charge at each side;
	// the replayed retry never reached the provider.
	wantCounts(t, counter, pool, order, 2, 1, 1)
	svc.stop(t)
	prov2.stop(t)
}

// The billing consumer is SIGKILLed after the provider charged and before
// the database commit ("charge.after-provider-call"): the event is
// redelivered, the provider sees the same key (derived from the event id)
// and replays; one charge on each side.
func TestConsumerCrashAfterProviderCall(t *testing.T) {
	k := newKafkaEnv(t)
	k.produceOrder(t, OrderConfirmed{EventID: "evt-p", OrderID: "o-p", Total: 800, Currency: "EUR"})
	c := startProcess(t, "consume", consuming, append(k.env, "IDEM_CRASH_AT=charge.after-provider-call")...)
	c.waitExit(t)
	if !c.killedBySIGKILL() {
		t.Fatalf("consumer ended %v, want SIGKILL at charge.after-provider-call:\n%s", c.cmd.ProcessState, c.log())
	}
	wantCounts(t, k.provider, k.pool, "o-p", 1, 1, 0)
	c = startProcess(t, "consume", consuming, k.env...)
	c.waitLog(t, billingOutcome("applied"))
	c.stop(t)
	wantCounts(t, k.provider, k.pool, "o-p", 2, 1, 1)
}

// serviceFor runs the service in the test process on dbURL, charging at
// providerURL.
func serviceFor(t *testing.T, dbURL, providerURL string) (*httptest.Server, *pgxpool.Pool) {
	t.Helper()
	t.Setenv("DATABASE_URL", dbURL)
	pool, err := open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	useProvider(providerURL)
	mux, err := newMux(pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, pool
}

// The provider refusing a charge (bytes it cannot store) is 422, not a
// retryable 502; the provider unreachable is 502 with nothing stored, and
// the retry after it is back charges once.
func TestChargeProviderRefusedOrDown(t *testing.T) {
	url := pgtest.Schema(t)
	p := providerFor(t, url)
	down, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	downURL := "http://" + down.Addr().String()
	down.Close() // nothing listens there now
	srv, pool := serviceFor(t, url, p.url)
	addr := strings.TrimPrefix(srv.URL, "http://")

	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"order_id":"order\u0000nul","amount":100,"currency":"EUR"}`))
	req.Header.Set("Idempotency-Key", "key-nul")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(string(b), "refused") {
		t.Fatalf("NUL in order_id: %d %s, want 422 (the provider refused)", resp.StatusCode, b)
	}

	useProvider(downURL)
	status, body, _, err := charge(addr, "key-down", "order-down")
	if err != nil || status != http.StatusBadGateway {
		t.Fatalf("provider down: %d %s %v, want 502", status, body, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Fatalf("%d keys stored after failures, want 0", n)
	}
	useProvider(p.url)
	if status, body, _, err := charge(addr, "key-down", "order-down"); err != nil || status != http.StatusCreated {
		t.Fatalf("retry with the provider back: %d %s %v", status, body, err)
	}
	wantCounts(t, p, pool, "order-down", 1, 1, 1)
}

// A provider that accepts the call and never answers, and a client that
// gives up: the operation's context is cancelled, the provider client
// returns at once with the context's error, and the transaction rolls back
// — the connection goes back to the pool long before the client's own
// 10s response timeout could have freed it.
func TestChargeCancelledWhileProviderHangs(t *testing.T) {
	url := pgtest.Schema(t)
	hang, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hang.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if conn, err := hang.Accept(); err == nil {
			accepted <- conn // held open, never answered
		}
	}()
	srv, pool := serviceFor(t, url, "http://"+hang.Addr().String())

	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/payments",
		strings.NewReader(`{"order_id":"order-hang","amount":100,"currency":"EUR"}`))
	req.Header.Set("Idempotency-Key", "key-hang")
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	var conn net.Conn
	select {
	case conn = <-accepted:
		defer conn.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the service never called the provider")
	}
	if pool.Stat().AcquiredConns() == 0 {
		t.Fatal("test setup: no transaction open while the provider hangs")
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for pool.Stat().AcquiredConns() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the operation still holds its transaction after the client went away")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem_keys`) + pgtest.Count(t, pool, `SELECT count(*) FROM charges`); n != 0 {
		t.Fatalf("%d rows stored by a cancelled operation, want 0", n)
	}
}
