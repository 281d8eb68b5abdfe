package faultproxy_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/faultproxy"
)

func produce(cl *kgo.Client, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return cl.ProduceSync(ctx, kgo.StringRecord("x")).FirstErr()
}

// kafkaClient connects through the first broker's proxy only: that the
// faults below stop it shows metadata does not route around the proxies.
//
// By default an idempotent kgo producer never fails a record whose request
// may have been written (e.g. into a connection that Down has just cut but
// the client has not noticed yet): it cannot know whether the broker got it.
// Such a produce ignores its context and waits for the broker to come back.
// AllowIdempotentProduceCancellation lets the 1s contexts below end it.
func kafkaClient(t *testing.T) (*kfake.Cluster, []*faultproxy.Proxy, *kgo.Client) {
	t.Helper()
	c, ps := faultproxy.KafkaCluster(t, 3, kfake.SeedTopics(3, "t"))
	if len(ps) != 3 {
		t.Fatalf("got %d proxies, want 3", len(ps))
	}
	for i, a := range c.ListenAddrs() {
		if a != ps[i].Addr() {
			t.Errorf("broker %d advertises %s, want its proxy %s", i, a, ps[i].Addr())
		}
	}
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(ps[0].Addr()),
		kgo.DefaultProduceTopic("t"),
		kgo.RecordPartitioner(kgo.RoundRobinPartitioner()), // reach every broker
		kgo.AllowIdempotentProduceCancellation(),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	for range 3 {
		if err := produce(cl, 10*time.Second); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
	return c, ps, cl
}

func TestKafkaDown(t *testing.T) {
	_, ps, cl := kafkaClient(t)
	faultproxy.Each(ps, (*faultproxy.Proxy).Down)
	if err := produce(cl, time.Second); err == nil {
		t.Fatal("produce while the cluster is down succeeded")
	}
	faultproxy.Each(ps, (*faultproxy.Proxy).Restore)
	if err := produce(cl, 15*time.Second); err != nil {
		t.Fatalf("produce after Restore: %v", err)
	}
}

func TestKafkaBlackhole(t *testing.T) {
	_, ps, cl := kafkaClient(t)
	faultproxy.Each(ps, (*faultproxy.Proxy).Blackhole)
	start := time.Now()
	if err := produce(cl, time.Second); err == nil {
		t.Fatal("produce while the cluster is blackholed succeeded")
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("produce in a blackhole failed after %v, before its deadline", d)
	}
	faultproxy.Each(ps, (*faultproxy.Proxy).Restore)
	if err := produce(cl, 15*time.Second); err != nil {
		t.Fatalf("produce after Restore: %v", err)
	}
}
