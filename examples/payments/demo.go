package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/idemgen/idemgen/examples/payments/db"
	idem "github.com/idemgen/idemgen/runtime"
)

// runDemo starts the service on a loopback port and plays a client that
// retries the way real clients do, checking every answer and, at the end,
// the charges in the database. It fails if any check fails.
func runDemo(ctx context.Context, out io.Writer) error {
	pool, err := open(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: newMux(pool)}
	served := make(chan error, 1)
	go func() { served <- idem.ServeHTTP(ctx, srv, ln, 5*time.Second) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	run := randomHex(4) // keys and orders are new on every run
	c := &demoClient{base: base, out: out}
	fmt.Fprintf(out, "payments demo: service on %s, run %s\n\n", base, run)

	order1, key1 := "order-"+run+"-1", "pay-"+run+"-1"
	body1 := fmt.Sprintf(`{"order_id":%q,"amount":4200,"currency":"EUR"}`, order1)
	first := c.post("1. charge an order", key1, body1)
	c.expect(first.status == http.StatusCreated, "201 Created, got %d", first.status)
	again := c.post("2. the client retries (the response was lost)", key1, body1)
	c.expect(again.status == http.StatusCreated && again.header.Get("Idempotent-Replayed") == "true",
		"replayed 201 with Idempotent-Replayed: true, got %d %q", again.status, again.header.Get("Idempotent-Replayed"))
	c.expect(bytes.Equal(first.body, again.body), "the replay is byte-identical to the first response")

	order2, key2 := "order-"+run+"-2", "pay-"+run+"-2"
	body2 := fmt.Sprintf(`{"order_id":%q,"amount":1500,"currency":"EUR"}`, order2)
	const n = 16
	fmt.Fprintf(out, "3. %d concurrent requests with one new key\n", n)
	answers := make([]reply, n)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() { defer wg.Done(); answers[i] = c.do(key2, body2) }()
	}
	wg.Wait()
	same := true
	for _, a := range answers {
		same = same && a.status == http.StatusCreated && bytes.Equal(a.body, answers[0].body)
	}
	c.expect(same, "all %d answered 201 with the same receipt", n)

	changed := c.post("4. the same key with a different amount", key1,
		fmt.Sprintf(`{"order_id":%q,"amount":9900,"currency":"EUR"}`, order1))
	c.expect(changed.status == http.StatusUnprocessableEntity, "422 problem+json, got %d", changed.status)

	missing := c.post("5. no Idempotency-Key", "", body1)
	c.expect(missing.status == http.StatusBadRequest, "400 problem+json, got %d", missing.status)

	order3, key3 := "order-"+run+"-3", "pay-"+run+"-3"
	bad := c.post("6. an invalid charge (amount 0)", key3, fmt.Sprintf(`{"order_id":%q,"amount":0,"currency":"EUR"}`, order3))
	c.expect(bad.status == http.StatusUnprocessableEntity, "422 from the handler, got %d", bad.status)
	fixed := c.post("7. the client fixes it and retries with the same key", key3,
		fmt.Sprintf(`{"order_id":%q,"amount":700,"currency":"EUR"}`, order3))
	c.expect(fixed.status == http.StatusCreated, "201: a failed attempt stored nothing, got %d", fixed.status)

	fmt.Fprintln(out, "8. charges in the database")
	q := db.New(pool)
	for _, order := range []string{order1, order2, order3} {
		count, err := q.CountCharges(ctx, order)
		if err != nil {
			return err
		}
		c.expect(count == 1, "%s charged exactly once (%d)", order, count)
	}

	if err := srv.Shutdown(ctx); err != nil {
		return err
	}
	<-served
	if c.failed > 0 {
		return fmt.Errorf("%d check(s) failed", c.failed)
	}
	fmt.Fprintln(out, "\nall checks passed")
	return nil
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

type demoClient struct {
	base   string
	out    io.Writer
	failed int
}

func (c *demoClient) post(step, key, body string) reply {
	fmt.Fprintf(c.out, "%s\n   POST /payments  Idempotency-Key: %q  %s\n", step, key, body)
	r := c.do(key, body)
	fmt.Fprintf(c.out, "   → %d %s", r.status, bytes.TrimSpace(r.body))
	if r.header.Get("Idempotent-Replayed") != "" {
		fmt.Fprint(c.out, "  (Idempotent-Replayed: true)")
	}
	fmt.Fprintln(c.out)
	return r
}

func (c *demoClient) do(key, body string) reply {
	req, err := http.NewRequest(http.MethodPost, c.base+"/payments", bytes.NewBufferString(body))
	if err != nil {
		return reply{body: []byte(err.Error())}
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return reply{body: []byte(err.Error()), header: http.Header{}}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b}
}

func (c *demoClient) expect(ok bool, format string, args ...any) {
	mark := "ok  "
	if !ok {
		mark = "FAIL"
		c.failed++
	}
	fmt.Fprintf(c.out, "   %s %s\n", mark, fmt.Sprintf(format, args...))
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
