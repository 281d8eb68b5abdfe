package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// kafkaEnv is one crash test's world: a kfake broker in the test process
// (it outlives the children the test kills), a fresh schema with the
// service's tables, and the environment the children run with.
type kafkaEnv struct {
	brokers  []string
	pool     *pgxpool.Pool
	env      []string
	provider *testProvider
}

func newKafkaEnv(t *testing.T) *kafkaEnv {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.confirmed", "billing.charged"),
		kfake.GroupMinSessionTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	url := pgtest.Schema(t)
	t.Setenv("DATABASE_URL", url)
	pool, err := open(context.Background()) // the service's own migration
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	brokers := cluster.ListenAddrs()
	prov := providerFor(t, url)
	return &kafkaEnv{brokers: brokers, pool: pool, provider: prov, env: []string{
		"DATABASE_URL=" + url, "KAFKA_BROKERS=" + strings.Join(brokers, ","), "KAFKA_SESSION_TIMEOUT=1s", "RELAY_LEASE=2s",
		"PROVIDER_URL=" + prov.url, "LOG_LEVEL=debug",
	}}
}

func (k *kafkaEnv) produceOrder(t *testing.T, ev OrderConfirmed) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	v, _ := json.Marshal(ev)
	if err := cl.ProduceSync(context.Background(), &kgo.Record{Topic: "orders.confirmed", Key: []byte(ev.OrderID), Value: v}).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

func (k *kafkaEnv) charges(t *testing.T, order string) int64 {
	return pgtest.Count(t, k.pool, `SELECT count(*) FROM charges WHERE order_id = $1`, order)
}

var billingOutcome = func(outcome string) *regexp.Regexp {
	return regexp.MustCompile(`record done context=billing topic=orders.confirmed partition=0 offset=0 outcome=` + outcome)
}

// The consumer is SIGKILLed after the database commit and before the offset
// commit. The restarted consumer gets the record again and skips it.
func TestConsumerCrashAfterCommitBeforeOffset(t *testing.T) {
	k := newKafkaEnv(t)
	k.produceOrder(t, OrderConfirmed{EventID: "evt-1", OrderID: "o-1", Total: 500, Currency: "EUR"})

	c := startProcess(t, "consume", consuming, append(k.env, "IDEM_CRASH_AT=consume.after-commit")...)
	c.waitExit(t)
	if !c.killedBySIGKILL() {
		t.Fatalf("consumer ended %v, want SIGKILL at the crash point:\n%s", c.cmd.ProcessState, c.log())
	}
	if n := k.charges(t, "o-1"); n != 1 {
		t.Fatalf("%d charges after the kill, want 1 (the transaction had committed)", n)
	}

	c = startProcess(t, "consume", consuming, k.env...)
	c.waitLog(t, billingOutcome("duplicate")) // redelivered: the offset was never committed
	c.stop(t)
	if n := k.charges(t, "o-1"); n != 1 {
		t.Fatalf("%d charges after redelivery, want 1", n)
	}
	wantCounts(t, k.provider, k.pool, "o-1", 1, 1, 1) // the duplicate never reached the provider
	// The shutdown committed the offset: a third run does not see it again.
	// It must be seen to consume, or "nothing delivered" would also hold for
	// a consumer that never joined: a new record at offset 1 is applied,
	// and offset 0 is not delivered before it.
	k.produceOrder(t, OrderConfirmed{EventID: "evt-1b", OrderID: "o-1b", Total: 100, Currency: "EUR"})
	c = startProcess(t, "consume", consuming, k.env...)
	c.waitLog(t, regexp.MustCompile(`record done context=billing topic=orders.confirmed partition=0 offset=1 outcome=applied`))
	c.stop(t)
	if strings.Contains(c.log(), "topic=orders.confirmed partition=0 offset=0 ") {
		t.Fatalf("the record was delivered again after a clean shutdown:\n%s", c.log())
	}
}

// The consumer is SIGKILLed after the handler's SQL and before the commit:
// everything rolls back, the record is redelivered and applied once.
func TestConsumerCrashBeforeCommit(t *testing.T) {
	k := newKafkaEnv(t)
	k.produceOrder(t, OrderConfirmed{EventID: "evt-2", OrderID: "o-2", Total: 700, Currency: "EUR"})

	c := startProcess(t, "consume", consuming, append(k.env, "IDEM_CRASH_AT=consume.after-call")...)
	c.waitExit(t)
	if !c.killedBySIGKILL() {
		t.Fatalf("consumer ended %v, want SIGKILL at the crash point:\n%s", c.cmd.ProcessState, c.log())
	}
	if n := k.charges(t, "o-2"); n != 0 {
		t.Fatalf("%d charges after the kill, want 0 (rolled back)", n)
	}
	if n := pgtest.Count(t, k.pool, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("%d outbox rows after the kill, want 0 (rolled back with the charge)", n)
	}
	wantCounts(t, k.provider, k.pool, "o-2", 1, 1, 0) // charged at the provider, rolled back here
	c = startProcess(t, "consume", consuming, k.env...)
	c.waitLog(t, billingOutcome("applied"))
	c.stop(t)
	if n := k.charges(t, "o-2"); n != 1 {
		t.Fatalf("%d charges, want 1", n)
	}
	wantCounts(t, k.provider, k.pool, "o-2", 2, 1, 1) // the redelivery's call replayed
}

// The relay is SIGKILLed between producing and marking. The restarted relay
// takes over, publishes the row again, and the notifications consumer applies
// the event once: relay at-least-once + consumer dedupe = exactly once.
func TestRelayCrashBetweenPublishAndMark(t *testing.T) {
	k := newKafkaEnv(t)
	ctx := context.Background()
	tx, err := k.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := EnqueuePaymentCharged(ctx, tx, PaymentCharged{ChargeID: 41, OrderID: "o-3", Amount: 900, Currency: "EUR"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	r := startProcess(t, "relay", leading, append(k.env, "IDEM_CRASH_AT=relay.after-publish")...)
	r.waitExit(t)
	if !r.killedBySIGKILL() {
		t.Fatalf("relay ended %v, want SIGKILL at the crash point:\n%s", r.cmd.ProcessState, r.log())
	}
	if n := pgtest.Count(t, k.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHING'`); n != 1 {
		t.Fatalf("%d PUBLISHING rows after the kill, want 1 (published, never marked)", n)
	}

	r = startProcess(t, "relay", leading, k.env...)
	deadline := time.Now().Add(30 * time.Second)
	for pgtest.Count(t, k.pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("row never PUBLISHED after restart:\n%s", r.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.stop(t)

	// billing.charged now holds the event twice; notifications applies it once.
	cfg, err := consumerConfig(k.brokers)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Handlers = IdemConsumers(&Billing{}, &Notifications{})[1:]
	outcomes := make(chan idem.Outcome, 10)
	cfg.OnRecord = func(_ *idem.EventHandler, _ *idem.Record, o idem.Outcome) { outcomes <- o }
	cons, err := kafka.NewConsumer(idem.NewStore(k.pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cons.Run(cctx) }()
	got := []idem.Outcome{<-outcomes, <-outcomes}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got[0] != idem.Applied || got[1] != idem.Duplicate {
		t.Fatalf("outcomes of the two deliveries: %v, want [applied duplicate]", got)
	}
	if n := pgtest.Count(t, k.pool, `SELECT count(*) FROM notifications WHERE order_id = 'o-3'`); n != 1 {
		t.Fatalf("%d notifications, want 1", n)
	}
}
