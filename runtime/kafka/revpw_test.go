package kafka_test

// Outside review of the bounded stop (stopWait) and abandoned workers.

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// A worker is abandoned (its handler blocks ignoring its context) when its
// partition moves to member B; then B leaves and the partition comes back
// to the same member A, whose fresh worker for it runs while the abandoned
// one still holds its transaction: two workers of one partition in one
// process. Once released, the abandoned handler writes its effect anyway
// (with a context that is not cancelled) and returns nil: that transaction
// must not commit, and the abandoned worker must mark nothing. The fresh
// worker applies every record exactly once, in order, and the committed
// offset reaches the end. The partition is paused (its worker stuck with
// records queued, MaxPollRecords 1) when the worker is abandoned: A's
// client must have resumed it, or the partition, back at A, is never
// fetched again.
func TestRevpwAbandonedWorkerPartitionBackToSameMember(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders", "other")
	pool := db(t)
	cl := manualProducer(t, addrs)
	ig := newCtxIgnorer("o-1")
	var calls sync.Map // event id -> number of calls, to tell the abandoned call from the fresh worker's
	stuck := func(ctx context.Context, tx pgx.Tx, ev order) error {
		n, _ := calls.LoadOrStore(ev.EventID, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		if ig.hold(ev) {
			// and then writes its effect with a context of its own
			return applyOrder(context.WithoutCancel(ctx), tx, ev)
		}
		return applyOrder(ctx, tx, ev)
	}
	logsA := &capture{}
	cfgA := kafka.ConsumerConfig{Brokers: addrs, Group: "back", MaxPollRecords: 1, CommitInterval: 100 * time.Millisecond,
		Logger: slog.New(logsA),
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", stuck),
			topicConsumer("other", "billing", applyOrder)}}
	produceTopic(t, cl, "orders", 0, "o", 0, 3)
	produceTopic(t, cl, "other", 0, "x", 0, 3)
	a := startConsumer(t, pool, cfgA, nil)
	ig.waitEntered(t)
	produceTopic(t, cl, "orders", 0, "o", 3, 2)
	waitBounded(t, 15*time.Second, "orders/0 paused behind the stuck o-1", func() bool {
		_, queued, _, paused, ok := kafka.WorkerHolds(a.c, "orders", 0)
		return ok && paused && queued > 0
	})
	t.Cleanup(ig.free)
	b := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "back", MaxPollRecords: 10,
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(&capture{}),
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder)}}, nil)
	waitBounded(t, kafka.StopWait()+15*time.Second, "A to abandon its orders/0 worker", func() bool {
		return logsA.has("a partition worker did not stop within the bound", "topic=orders", "partition=0", "offset=1")
	})
	// B owns orders/0 now (its worker waits on o-1's processed-event row,
	// locked by the abandoned transaction). B leaves: orders/0 comes back
	// to A, which starts a fresh worker while the abandoned one still
	// blocks.
	b.shutdown(t)
	waitBounded(t, 30*time.Second, "orders/0 assigned back to A", func() bool {
		return logsA.has("partitions assigned", "map[orders:[0]]")
	})
	produceTopic(t, cl, "orders", 0, "o", 5, 2)
	// Both of A's workers now hold orders/0: nothing past o-1 can be
	// applied or committed while o-1's first transaction is open.
	time.Sleep(500 * time.Millisecond) // a look at a state that must not change, not a wait for one
	if n := appliedCount(t, pool, "o"); n != 1 {
		t.Fatalf("%d of orders' records applied while o-1 is held, want 1 (o-0)", n)
	}
	if got := committedOffsets(t, addrs, "back", "orders", 1); got[0] > 1 {
		t.Fatalf("orders/0 committed at %d past o-1, whose transaction is open", got[0])
	}
	ig.free()
	waitBounded(t, 30*time.Second, "A's fresh worker applies orders/0 to the end", func() bool {
		return appliedCount(t, pool, "o") == 7
	})
	waitBounded(t, 15*time.Second, "orders/0 committed to the end", func() bool {
		return committedIs(t, addrs, "back", 1, map[int32]int64{0: 7})
	})
	wantAppliedInOrder(t, pool, "o", 7)
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events WHERE event_id LIKE 'o-%'`); n != 7 {
		t.Fatalf("%d processed-event rows for orders, want 7", n)
	}
	if v, _ := calls.Load("o-1"); v == nil || v.(*atomic.Int64).Load() < 2 {
		t.Fatalf("o-1 handled fewer than twice, want the abandoned call and at least one by a later worker")
	}
}
