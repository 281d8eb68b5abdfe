package kafka_test

// Handlers that ignore their context: found by the attackpw review (a
// revoke or a shutdown waited for them without a bound, stalling the
// member's other partitions and Run). A revoke, a loss and a shutdown now
// wait at most kafka.StopWait() for a cancelled worker, then abandon it.

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// A handler that blocks ignoring its context (until the test releases it),
// on topic "orders", while the same member also consumes topic "other". A
// second member joins that consumes "orders" only, so the cooperative
// rebalance must move orders/0 away from the first member: the revoke
// waits for the stuck worker, and franz-go polls nothing meanwhile. The
// wait is bounded (kafka.StopWait()): records produced to "other" during
// the revoke are applied once it has passed and the worker is abandoned.
// Without the bound the member stalled for as long as the handler blocked.
func TestAttackPWCtxIgnoringHandlerRevokeStallsOtherPartitions(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders", "other")
	pool := db(t)
	cl := manualProducer(t, addrs)
	ig := newCtxIgnorer("o-1")
	stuck := func(ctx context.Context, tx pgx.Tx, ev order) error {
		ig.hold(ev)
		return applyOrder(ctx, tx, ev)
	}
	logsA := &capture{}
	cfgA := kafka.ConsumerConfig{Brokers: addrs, Group: "ign", MaxPollRecords: 10, CommitInterval: 100 * time.Millisecond,
		Logger: slog.New(logsA),
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", stuck),
			topicConsumer("other", "billing", applyOrder)}}
	produceTopic(t, cl, "orders", 0, "o", 0, 3)
	produceTopic(t, cl, "other", 0, "x", 0, 3)
	startConsumer(t, pool, cfgA, nil)
	ig.waitEntered(t)
	waitBounded(t, 15*time.Second, "other's first records", func() bool { return appliedCount(t, pool, "x") == 3 })
	logsB := &capture{}
	cfgB := kafka.ConsumerConfig{Brokers: addrs, Group: "ign", MaxPollRecords: 10, CommitInterval: 100 * time.Millisecond,
		Logger:   slog.New(logsB),
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder)}}
	startConsumer(t, pool, cfgB, nil)
	t.Cleanup(ig.free) // registered last: runs before the consumers' shutdowns
	waitBounded(t, 15*time.Second, "A to start revoking orders/0", func() bool {
		return logsA.has("partitions revoked", "orders:[0]")
	})
	produceTopic(t, cl, "other", 0, "x", 3, 5)
	start := time.Now()
	deadline := start.Add(stallBound())
	for appliedCount(t, pool, "x") < 8 {
		if time.Now().After(deadline) {
			t.Fatalf("topic other's partition stalled for %v behind the revoke of orders/0 (applied %d of 8); "+
				"the revoke should have abandoned the worker after %v", time.Since(start).Round(time.Millisecond), appliedCount(t, pool, "x"), kafka.StopWait())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("topic other stalled %v behind the revoke of orders/0", time.Since(start).Round(time.Millisecond))
	waitBounded(t, 5*time.Second, "the abandonment logged", func() bool {
		return logsA.has("a partition worker did not stop within the bound", "topic=orders", "partition=0", "offset=1")
	})
	// orders/0 has moved to B. Released, the abandoned handler's
	// transaction rolls back (its context is cancelled), and B applies
	// orders/0 from o-1: every record exactly once, in order.
	produceTopic(t, cl, "orders", 0, "o", 3, 2)
	ig.free()
	waitBounded(t, 30*time.Second, "B applies orders/0 from o-1", func() bool { return appliedCount(t, pool, "o") == 5 })
	wantAppliedInOrder(t, pool, "o", 5)
}

// stallBound is how long TestAttackPWCtxIgnoringHandlerRevokeStallsOtherPartitions
// lets the other topic stall: the bounded wait for the stuck worker, and
// a margin for the rebalance and the polls.
func stallBound() time.Duration { return kafka.StopWait() + 5*time.Second }

// Shutdown with a handler that blocks ignoring its context: Run returns
// once the bounded wait for the worker (kafka.StopWait()) has passed.
func TestAttackPWCtxIgnoringHandlerShutdown(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	ig := newCtxIgnorer("s-1")
	stuck := func(ctx context.Context, tx pgx.Tx, ev order) error {
		ig.hold(ev)
		return applyOrder(ctx, tx, ev)
	}
	defer ig.free()
	produceTo(t, addrs, 0, "s", 0, 3)
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{Brokers: addrs, Group: "ignshut",
		Handlers:   []idem.EventHandler{orderConsumer("orders", stuck)},
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	ig.waitEntered(t)
	start := time.Now()
	cancel()
	bound := kafka.StopWait() + 5*time.Second
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		t.Logf("Run returned %v after its context was cancelled", time.Since(start).Round(time.Millisecond))
	case <-time.After(bound):
		t.Errorf("Run did not return %v after its context was cancelled, with a handler ignoring its context", bound)
		ig.free()
		<-done
	}
}

// ctxIgnorer makes a handler block on one event, ignoring its context, as a
// buggy handler would, until the test frees it.
type ctxIgnorer struct {
	stuckID          string
	entered, release chan struct{}
	enter, freed     sync.Once
}

func newCtxIgnorer(stuckID string) *ctxIgnorer {
	return &ctxIgnorer{stuckID: stuckID, entered: make(chan struct{}), release: make(chan struct{})}
}

// hold blocks the first call for the stuck event until free, ignoring the
// context, and reports whether it was that call.
func (c *ctxIgnorer) hold(ev order) bool {
	if ev.EventID != c.stuckID {
		return false
	}
	first := false
	c.enter.Do(func() { first = true; close(c.entered) })
	if first {
		<-c.release
	}
	return first
}

// waitEntered waits for the stuck event's first call to block.
func (c *ctxIgnorer) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-c.entered:
	case <-time.After(30 * time.Second):
		t.Fatalf("handler never reached %s", c.stuckID)
	}
}

// free releases the blocked call (and any later one); safe to call twice.
func (c *ctxIgnorer) free() { c.freed.Do(func() { close(c.release) }) }
