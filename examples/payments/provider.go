package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemgen/idemgen/examples/payments/db"
	"github.com/idemgen/idemgen/examples/payments/provider"
	"github.com/idemgen/idemgen/runtime/idem"
)

// The payment provider's default address: `payments provider` listens on
// it, and the service calls it when PROVIDER_URL is not set.
const defaultProviderAddr = "127.0.0.1:8081"

// providerChargeCall names the provider call of a charge: with the
// operation's key it gives the Idempotency-Key the provider sees (and the
// charge row stores as provider_key).
const providerChargeCall = "provider.charge"

// runProvider is `payments provider`: the payment provider as its own
// process, on $PROVIDER_ADDR, storing in the provider_* tables of
// $DATABASE_URL, until SIGTERM.
func runProvider(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		return fmt.Errorf("provider: connect: %w", err)
	}
	defer pool.Close()
	if err := provider.Migrate(ctx, pool); err != nil {
		return err
	}
	addr := os.Getenv("PROVIDER_ADDR")
	if addr == "" {
		addr = defaultProviderAddr
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("provider: %w", err)
	}
	slog.Info("provider listening", "addr", ln.Addr().String())
	srv := &http.Server{Handler: provider.New(pool, nil).Handler(), ReadHeaderTimeout: 5 * time.Second}
	err = idem.ServeHTTP(ctx, srv, ln, idem.ServeConfig{Drain: 5 * time.Second})
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// providerCallTimeout bounds one charge call, its retries and the reading of
// the answer: ResponseHeaderTimeout bounds each attempt's wait for headers,
// but nothing else bounds a provider that sends headers and stalls its
// body, and a consumer's context never ends on its own.
var providerCallTimeout = 60 * time.Second

// providerClient is the service's side of the provider: an idem client, so
// every attempt and every re-run of one charge operation sends the same key.
type providerClient struct {
	base    string
	http    *http.Client
	timeout time.Duration // a whole call, see providerCallTimeout
}

func newProviderClient(baseURL string) *providerClient {
	t := http.DefaultTransport.(*http.Transport).Clone()
	// A provider that accepts the request and never answers is a failed
	// attempt, retried with the same key, not a transaction held forever.
	t.ResponseHeaderTimeout = 10 * time.Second
	return &providerClient{base: strings.TrimRight(baseURL, "/"), http: idem.NewClient(t, idem.ClientConfig{}), timeout: providerCallTimeout}
}

var paymentProvider struct {
	sync.Mutex
	client *providerClient
}

// useProvider points the service at the provider at baseURL (the demo's
// in-process one). Without it, the service uses $PROVIDER_URL, or
// http://127.0.0.1:8081.
func useProvider(baseURL string) {
	paymentProvider.Lock()
	defer paymentProvider.Unlock()
	paymentProvider.client = newProviderClient(baseURL)
}

func currentProvider() *providerClient {
	paymentProvider.Lock()
	defer paymentProvider.Unlock()
	if paymentProvider.client == nil {
		url := os.Getenv("PROVIDER_URL")
		if url == "" {
			url = "http://" + defaultProviderAddr
		}
		paymentProvider.client = newProviderClient(url)
	}
	return paymentProvider.client
}

// charge asks the provider to charge, inside the operation running under
// ctx. A cancelled ctx comes back as ctx.Err() itself; a call that outlasts
// c.timeout is an error (the provider did not confirm), not ctx's.
func (c *providerClient) charge(ctx context.Context, req provider.ChargeRequest) (provider.Charge, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return provider.Charge{}, fmt.Errorf("encode provider charge: %w", err)
	}
	callCtx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	hreq, err := http.NewRequestWithContext(idem.WithCallName(callCtx, providerChargeCall), http.MethodPost, c.base+"/charges", bytes.NewReader(body))
	if err != nil {
		return provider.Charge{}, fmt.Errorf("provider charge request: %w", err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(hreq)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return provider.Charge{}, ctxErr
		}
		return provider.Charge{}, fmt.Errorf("call the payment provider (the call may take %v): %w", c.timeout, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return provider.Charge{}, ctxErr
		}
		return provider.Charge{}, fmt.Errorf("read the payment provider's answer (the call may take %v): %w", c.timeout, err)
	}
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
		return provider.Charge{}, &providerError{status: resp.StatusCode, body: string(bytes.TrimSpace(b))}
	}
	var ch provider.Charge
	if err := json.Unmarshal(b, &ch); err != nil {
		return provider.Charge{}, fmt.Errorf("decode the payment provider's answer: %w", err)
	}
	return ch, nil
}

// databaseURL is $DATABASE_URL, or the local server.
func databaseURL() string {
	if url := os.Getenv("DATABASE_URL"); url != "" {
		return url
	}
	return defaultDatabaseURL
}

// demoProvider is the provider the demo runs in-process: its own pool, its
// own listener, its own tables.
type demoProvider struct {
	*provider.Server
	url  string
	stop func()
}

// startDemoProvider starts the provider on a loopback port and points the
// service at it.
func startDemoProvider(ctx context.Context) (*demoProvider, error) {
	pool, err := pgxpool.New(ctx, databaseURL())
	if err != nil {
		return nil, fmt.Errorf("provider: connect: %w", err)
	}
	if err := provider.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("provider: %w", err)
	}
	p := provider.New(pool, nil)
	srv := &http.Server{Handler: p.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	d := &demoProvider{Server: p, url: "http://" + ln.Addr().String()}
	d.stop = func() { _ = srv.Close(); pool.Close() }
	useProvider(d.url)
	return d, nil
}

// checkDoubleProtection prints, per order, the provider's raw calls and
// applied charges next to the service's charges, and checks the seed's
// double protection: calls ≥ provider charges = charges in the database = 1.
func (c *demoClient) checkDoubleProtection(ctx context.Context, p *demoProvider, pool *pgxpool.Pool, orders []string) error {
	fmt.Fprintf(c.out, "   %-24s %14s %16s %14s\n", "order", "provider calls", "provider charges", "our charges")
	q := db.New(pool)
	var wrong []string
	for _, o := range orders {
		calls, charged, err := p.Counts(ctx, o)
		if err != nil {
			return err
		}
		ours, err := q.CountCharges(ctx, o)
		if err != nil {
			return err
		}
		fmt.Fprintf(c.out, "   %-24s %14d %16d %14d\n", o, calls, charged, ours)
		if calls < charged || charged != 1 || ours != 1 {
			wrong = append(wrong, o)
		}
	}
	c.expect(len(wrong) == 0, "every order: provider calls ≥ provider charges = our charges = 1 (wrong: %v)", wrong)
	return nil
}

// providerError is a provider's answer other than a charge: after the
// client's retries for 408/409/425/429/5xx, or at once for any other status.
type providerError struct {
	status int
	body   string
}

func (e *providerError) Error() string {
	return fmt.Sprintf("payment provider answered %d: %s", e.status, e.body)
}

// refused reports whether the provider refused the charge itself (a 4xx
// its retries cannot change), as opposed to being unavailable.
func (e *providerError) refused() bool {
	return e.status >= 400 && e.status < 500 && !idem.DefaultRetryStatus(e.status)
}
