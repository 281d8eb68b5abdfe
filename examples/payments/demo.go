package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/examples/payments/db"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
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
	prov, err := startDemoProvider(ctx)
	if err != nil {
		return err
	}
	defer prov.stop()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	mux, err := newMux(pool)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux}
	served := make(chan error, 1)
	go func() { served <- idem.ServeHTTP(ctx, srv, ln, idem.ServeConfig{Drain: 5 * time.Second}) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	run := randomHex(4) // keys and orders are new on every run
	c := &demoClient{base: base, out: out}
	fmt.Fprintf(out, "payments demo: service on %s, payment provider on %s, run %s\n\n", base, prov.url, run)

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

	order4, key4 := "order-"+run+"-4", "pay-"+run+"-4"
	prov.LoseNextResponse(order4)
	// On a fresh connection: net/http re-sends a request carrying an
	// Idempotency-Key by itself when a reused connection drops it, which
	// would hide whether the idem client's own retry keeps the key.
	currentProvider().http.CloseIdleConnections()
	lost := c.post("8. the provider charges, but its answer to the service is lost on the way", key4,
		fmt.Sprintf(`{"order_id":%q,"amount":2500,"currency":"EUR"}`, order4))
	c.expect(lost.status == http.StatusCreated, "201: the service retried the provider with the same key and got the charge back, got %d", lost.status)

	fmt.Fprintln(out, "9. charges at the provider and in the database")
	httpOrders := []string{order1, order2, order3, order4}
	if err := c.checkDoubleProtection(ctx, prov, pool, httpOrders); err != nil {
		return err
	}
	calls, _, err := prov.Counts(ctx, order4)
	if err != nil {
		return err
	}
	c.expect(calls >= 2, "%s: the lost answer cost a second call (%d), not a second charge", order4, calls)

	if err := srv.Shutdown(ctx); err != nil {
		return err
	}
	<-served

	kafkaOrders, err := kafkaDemo(ctx, out, pool, c, run, httpOrders)
	if err != nil {
		return err
	}
	fmt.Fprintln(out, "\n11. the seed's double protection, every order: the provider's key dedupe and ours")
	if err := c.checkDoubleProtection(ctx, prov, pool, append(httpOrders, kafkaOrders...)); err != nil {
		return err
	}
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

// kafkaDemo plays the orders service: it publishes OrderConfirmed events,
// each three times, as an at-least-once producer may. Billing charges each
// order once; every charge (the HTTP ones too) goes out through the outbox;
// notifications sends one receipt per charge.
func kafkaDemo(ctx context.Context, out io.Writer, pool *pgxpool.Pool, c *demoClient, run string, httpOrders []string) ([]string, error) {
	brokers, embedded := strings.Split(os.Getenv("KAFKA_BROKERS"), ","), false
	if os.Getenv("KAFKA_BROKERS") == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "orders.confirmed", "billing.charged"))
		if err != nil {
			return nil, fmt.Errorf("embedded kafka: %w", err)
		}
		defer cluster.Close()
		brokers, embedded = cluster.ListenAddrs(), true
	}
	fmt.Fprintf(out, "\n10. Kafka (%s): billing consumes orders.confirmed, the relay publishes billing.charged, notifications consumes it\n",
		map[bool]string{true: "embedded kfake broker at " + strings.Join(brokers, ","), false: "KAFKA_BROKERS=" + strings.Join(brokers, ",")}[embedded])

	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	cfg, err := consumerConfig(brokers)
	if err != nil {
		return nil, err
	}
	cfg.Group = "payments-demo-" + run
	consumer, err := kafka.NewConsumer(idem.NewStore(pool), cfg)
	if err != nil {
		return nil, err
	}
	pub, err := kafka.NewPublisher(brokers)
	if err != nil {
		return nil, err
	}
	defer pub.Close()
	relay, err := idem.NewRelay(idem.NewStore(pool), pub, idem.RelayConfig{})
	if err != nil {
		return nil, err
	}
	wg.Add(2)
	go func() { defer wg.Done(); _ = consumer.Run(ctx) }()
	go func() { defer wg.Done(); _ = relay.Run(ctx) }()

	producer, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.AllowAutoTopicCreation())
	if err != nil {
		return nil, err
	}
	defer producer.Close()
	var orders []string
	var recs []*kgo.Record
	for i := 1; i <= 5; i++ {
		ev := OrderConfirmed{EventID: fmt.Sprintf("evt-%s-%d", run, i), OrderID: fmt.Sprintf("order-%s-k%d", run, i), Total: int64(1000 * i), Currency: "EUR"}
		orders = append(orders, ev.OrderID)
		value, _ := json.Marshal(ev)
		for copy := 0; copy < 3; copy++ {
			recs = append(recs, &kgo.Record{Topic: "orders.confirmed", Key: []byte(ev.OrderID), Value: value})
		}
	}
	if err := producer.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return nil, fmt.Errorf("produce: %w", err)
	}
	fmt.Fprintf(out, "   produced %d OrderConfirmed records: 5 events, each delivered 3 times\n", len(recs))

	q := db.New(pool)
	all := append(append([]string{}, httpOrders...), orders...)
	done := func() bool {
		for _, o := range all {
			charges, err1 := q.CountCharges(ctx, o)
			notes, err2 := q.CountNotifications(ctx, o)
			if err1 != nil || err2 != nil || charges < 1 || notes < 1 {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(60 * time.Second)
	for !done() && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // let any duplicate show itself
	for _, o := range orders {
		charges, err := q.CountCharges(ctx, o)
		if err != nil {
			return nil, err
		}
		c.expect(charges == 1, "%s (3 deliveries) charged exactly once (%d)", o, charges)
	}
	for _, o := range all {
		notes, err := q.CountNotifications(ctx, o)
		if err != nil {
			return nil, err
		}
		c.expect(notes == 1, "%s: one receipt sent via outbox → billing.charged → notifications (%d)", o, notes)
	}
	counts, err := idem.NewStore(pool).OutboxCounts(ctx)
	if err != nil {
		return nil, err
	}
	c.expect(counts["PENDING"] == 0 && counts["PUBLISHING"] == 0, "outbox drained: %v", counts)
	return orders, nil
}
