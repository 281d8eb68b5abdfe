package kafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// A topic deleted and re-created while partition 0's worker is slowly
// applying queued records of the old instance (200ms each, not stuck),
// marking each. The new instance's committed offset must never pass what
// was applied of it: an old-instance mark committed into the new instance
// would skip the new instance's first records. kfake's own versions:
// OffsetCommit v10 names the topic by ID, so an old-instance commit is
// refused (UNKNOWN_TOPIC_ID). Holds on main.
func TestRecreatedTopicSlowOldWorker(t *testing.T) {
	t.Parallel()
	testSlowOldWorker(t, nil)
}

func testSlowOldWorker(t *testing.T, opts []kfake.Opt) {
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(2, "orders")}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	addrs := c.ListenAddrs()
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "old0", 0, 40)
	produceTopic(t, cl, "orders", 1, "old1", 0, 10)
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if len(ev.EventID) > 4 && ev.EventID[:4] == "old0" {
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return applyOrder(ctx, tx, ev)
	}
	logs := &capture{}
	group := "slowold"
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: 5,
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs),
		ClientOpts: []kgo.Opt{kgo.FetchMaxPartitionBytes(1)},
		Handlers:   []idem.EventHandler{orderConsumer("orders", handler)}}, nil)
	waitBounded(t, 15*time.Second, "old0 partly applied, old1 applied", func() bool {
		return appliedCount(t, pool, "old0") >= 3 && appliedCount(t, pool, "old1") == 10
	})
	fresh := recreateTopic(t, addrs, "orders", 2)
	produceTopic(t, fresh, "orders", 0, "new0", 0, 40)
	produceTopic(t, fresh, "orders", 1, "new1", 0, 10)
	var bad []string
	check := func() {
		// The commit first: what is applied only grows, so a commit
		// above what is applied after it passed unapplied records.
		c := committedOffsets(t, addrs, group, "orders", 2)
		a0, a1 := appliedCount(t, pool, "new0"), appliedCount(t, pool, "new1")
		if (c[0] > a0 || c[1] > a1) && len(bad) < 3 {
			bad = append(bad, fmt.Sprintf("committed %v with new0 %d, new1 %d applied", c, a0, a1))
		}
	}
	// Until the group has committed both partitions' ends: then every
	// record below them must have been applied.
	deadline := time.Now().Add(40 * time.Second)
	for {
		check()
		if c := committedOffsets(t, addrs, group, "orders", 2); c[0] == 40 && c[1] == 10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("40s after the re-creation: new0 %d/40, new1 %d/10 applied, committed %v; bad %v",
				appliedCount(t, pool, "new0"), appliedCount(t, pool, "new1"), committedOffsets(t, addrs, group, "orders", 2), bad)
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.shutdown(t)
	check()
	if len(bad) > 0 {
		t.Errorf("the new instance's committed offset passed its applied records: %v", bad)
	}
	wantAppliedInOrder(t, pool, "new0", 40)
	wantAppliedInOrder(t, pool, "new1", 10)
}

// A consumed topic deleted and not re-created for 6s, another topic flowing
// all the while: the other topic's records go on being applied, nothing
// loops (kgo fetches nothing for a topic missing from the metadata: no
// UNKNOWN_TOPIC_ID, no purge while it is gone), and the topic created later
// is recovered (one purge) and consumed from its start, within 40s (about
// 5s seen). Holds on main.
func TestRecreatedTopicDeletedThenCreatedLater(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders", "other")
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "old0", 0, 5)
	logs := &capture{}
	var purges atomic.Int64
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "deletedlater",
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs),
		Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder), topicConsumer("other", "billing", applyOrder)}}, nil,
		func(c *kafka.Consumer) { kafka.SetBeforePurge(c, func(string) { purges.Add(1) }) })
	waitBounded(t, 15*time.Second, "old0 applied", func() bool { return appliedCount(t, pool, "old0") == 5 })
	adm := outsiderProducer(t, addrs)
	kmsgDeleteTopic(t, adm, "orders")
	n := 0
	produceOther := func(k int) {
		produceTopic(t, cl, "other", 0, "x", n, k)
		n += k
	}
	// Six seconds without the topic, a trickle on the other one.
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); {
		produceOther(1)
		time.Sleep(50 * time.Millisecond)
	}
	waitBounded(t, 10*time.Second, "the other topic applied all the while", func() bool { return appliedCount(t, pool, "x") == int64(n) })
	t.Logf("%d purges while the topic was deleted", purges.Load())
	kmsgCreateTopic(t, adm, "orders", 1)
	fresh := manualProducer(t, addrs)
	produceTopic(t, fresh, "orders", 0, "new0", 0, 10)
	start := time.Now()
	waitBounded(t, 40*time.Second, "the topic created later consumed", func() bool { return appliedCount(t, pool, "new0") == 10 })
	t.Logf("consumed %v after the creation; %d purges", time.Since(start).Round(time.Millisecond), purges.Load())
	wantAppliedInOrder(t, pool, "new0", 10)
	r.shutdown(t)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	lines := 0
	for _, l := range logs.lines {
		if strings.Contains(l, "fetch error") || strings.Contains(l, "re-created") || strings.Contains(l, "still failing") {
			lines++
		}
	}
	if lines > 20 {
		t.Errorf("%d error lines about the deleted topic", lines)
	}
}

// A topic of two partitions re-created with one while the old instance's
// partition 1 worker is stuck on a record (its handler waits for its
// context) and partition 0's flows: the old partition 1 worker is stopped
// (it has no partition in the new instance, and no revoke stops it), the
// new instance's only partition is consumed from its start, and shutdown
// is prompt. Holds on main.
func TestRecreatedTopicFewerPartitions(t *testing.T) {
	t.Parallel()
	addrs, pool := oldOrders(t, 10, 10)
	var stuck atomic.Bool
	handler := stuckUntilCancelled("old1-3", &stuck)
	var left atomic.Value
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "fewer", CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)}}, nil,
		func(c *kafka.Consumer) {
			kafka.SetBeforePurge(c, func(topic string) { left.Store(fmt.Sprint(workersOf(c, topic, 2))) })
		})
	waitBounded(t, 15*time.Second, "old0 applied, old1 stuck", func() bool {
		return appliedCount(t, pool, "old0") == 10 && stuck.Load()
	})
	fresh := recreateTopic(t, addrs, "orders", 1)
	produceTopic(t, fresh, "orders", 0, "new0", 0, 10)
	waitBounded(t, 30*time.Second, "the new instance's partition consumed", func() bool { return appliedCount(t, pool, "new0") == 10 })
	wantAppliedInOrder(t, pool, "new0", 10)
	if l, _ := left.Load().(string); l != "[]" {
		t.Errorf("workers of the old instance at the purge: %s, want none", l)
	}
	if _, _, _, _, ok := kafka.WorkerHolds(r.c, "orders", 1); ok {
		t.Errorf("a worker of orders/1 is left, which the new instance does not have")
	}
	start := time.Now()
	r.shutdown(t)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("shutdown took %v", d)
	}
	waitBounded(t, 10*time.Second, "new0 committed", func() bool { return committedOffsets(t, addrs, "fewer", "orders", 1)[0] == 10 })
}

// Shutdown right at the recovery of a re-created topic (the context is
// cancelled just before the purge, old partition 0 worker stuck): Run
// returns promptly, and a consumer started again in the group consumes the
// new instance from its start, each record once, in order. Holds on main.
func TestRecreatedTopicShutdownAtPurge(t *testing.T) {
	t.Parallel()
	addrs, pool := oldOrders(t, 10, 10)
	var stuck atomic.Bool
	handler := stuckUntilCancelled("old0-3", &stuck)
	var r *running
	atPurge := make(chan struct{})
	var once sync.Once
	r = startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "shutpurge", CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)}}, nil,
		func(c *kafka.Consumer) {
			kafka.SetBeforePurge(c, func(string) { once.Do(func() { r.stop(); close(atPurge) }) })
		})
	waitBounded(t, 15*time.Second, "old1 applied, old0 stuck", func() bool {
		return appliedCount(t, pool, "old1") == 10 && stuck.Load()
	})
	fresh := recreateTopic(t, addrs, "orders", 2)
	produceTopic(t, fresh, "orders", 0, "new0", 0, 10)
	produceTopic(t, fresh, "orders", 1, "new1", 0, 10)
	select {
	case <-atPurge:
	case <-time.After(20 * time.Second):
		t.Fatal("the re-created topic was never purged")
	}
	start := time.Now()
	r.shutdown(t)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("shutdown at the purge took %v", d)
	}
	if c := committedOffsets(t, addrs, "shutpurge", "orders", 2); c[0] > 0 || c[1] > 0 {
		t.Errorf("committed %v on the new instance, nothing of it applied", c)
	}
	r2 := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "shutpurge", CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder)}}, nil)
	waitBounded(t, 20*time.Second, "the new instance consumed after the restart", func() bool {
		return appliedCount(t, pool, "new0") == 10 && appliedCount(t, pool, "new1") == 10
	})
	wantAppliedInOrder(t, pool, "new0", 10)
	wantAppliedInOrder(t, pool, "new1", 10)
	r2.shutdown(t)
}
