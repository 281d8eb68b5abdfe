package kafka_test

// Regression tests for two fixes of the bounded stop (stopWait) that had
// none: an abandoned worker marks nothing (worker.abandoned), and a
// shutdown during the fetch-error backoff stops the workers before
// AllowRebalance.

import (
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// An abandoned worker marks nothing. The one place its mark takes effect
// is a partition this member consumes again: kgo ignores marks for
// partitions it does not consume and never moves a mark back, and the
// worker only marks records whose transactions committed. Consumed again
// from the same topic, such a mark is at most early; from a topic deleted
// and re-created meanwhile, it is an offset of the old topic applied to
// the new one, and the new topic's records below it are skipped.
//
// OnRecord (application code, without a context) blocks after o-4's
// transaction committed, before the worker marks it. The topic is deleted
// and re-created: the consumer purges it (a revoke), gives up on the
// worker after stopWait, and consumes the new topic, whose first records
// n-0 and n-1 are applied and committed (offset 2). Released, the
// abandoned worker went on to mark o-4 (offset 5) into the new topic:
// committed at the shutdown, and a consumer starting there skipped n-2 to
// n-4.
func TestAbandonedWorkerMarksNothingIntoRecreatedTopic(t *testing.T) {
	defer kafka.SetStopWait(300 * time.Millisecond)() // not parallel: StopWait is global
	addrs := cluster(t, 1, "orders")
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "o", 0, 5)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	onRecord := func(_ *idem.EventHandler, rec *idem.Record, _ idem.Outcome) {
		var ev order
		if json.Unmarshal(rec.Value, &ev) == nil && ev.EventID == "o-4" {
			close(entered)
			<-release
		}
	}
	logs := &capture{}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "amark", CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs),
		OnRecord: onRecord, Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder)}}
	r := startConsumer(t, pool, cfg, nil)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("OnRecord never reached o-4")
	}
	if n := appliedCount(t, pool, "o"); n != 5 {
		t.Fatalf("%d of o-0..o-4 applied before o-4's OnRecord, want 5", n)
	}
	adm := outsiderProducer(t, addrs)
	kmsgDeleteTopic(t, adm, "orders")
	kmsgCreateTopic(t, adm, "orders", 1)
	waitBounded(t, 30*time.Second, "the old topic's worker abandoned", func() bool {
		return logs.has("a partition worker did not stop within the bound", "topic=orders", "partition=0")
	})
	cl = manualProducer(t, addrs) // the old one knows the old topic's ID
	produceTopic(t, cl, "orders", 0, "n", 0, 2)
	waitBounded(t, 30*time.Second, "n-0 and n-1 applied", func() bool { return appliedCount(t, pool, "n") == 2 })
	waitBounded(t, 15*time.Second, "the new topic committed at 2", func() bool { return committedIs(t, addrs, "amark", 1, map[int32]int64{0: 2}) })
	// The abandoned worker marks (or not) within microseconds of
	// OnRecord's return; the shutdown's final commit comes milliseconds
	// after this.
	once.Do(func() { close(release) })
	r.shutdown(t)
	if got := committedOffsets(t, addrs, "amark", "orders", 1); got[0] != 2 {
		t.Errorf("the new topic committed at %d after the shutdown, want 2 (n-0, n-1): the abandoned worker of the old topic marked into it", got[0])
	}
	produceTopic(t, cl, "orders", 0, "n", 2, 3)
	r2 := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "amark", CommitInterval: 100 * time.Millisecond,
		Logger: slog.New(&capture{}), Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder)}}, nil)
	waitBounded(t, 30*time.Second, "the new topic committed to its end (5)", func() bool {
		return committedIs(t, addrs, "amark", 1, map[int32]int64{0: 5})
	})
	r2.shutdown(t)
	if n := appliedCount(t, pool, "n"); n != 5 {
		t.Errorf("%d of n-0..n-4 applied, want 5: records of the new topic were skipped", n)
	}
}

// A shutdown that comes while the poll loop waits out failing fetches (the
// backoff) stops the workers with rebalances blocked, as a shutdown at the
// top of the loop does. It stopped them right after the backoff, after
// AllowRebalance: a revoke that came meanwhile found the workers already
// taken by the shutdown, did not wait for them, and committed without the
// offsets they marked on their way out, and the partition's next owner
// applied those records again (duplicates).
//
// Member A consumes orders, other and gone; its worker for orders/0 is held
// in OnRecord after o-1's transaction committed, before o-1 is marked. gone
// is deleted and re-created, so A's fetches fail and its poll loop waits in the backoff
// (held there: SetFetchBackoffFloor). A is shut down: its Run takes the
// orders/0 worker and waits for it. Member B, consuming orders only, joins:
// orders/0 must move to B. While A's worker is held, A must not revoke
// orders/0; once it is released, A marks o-1 and commits it, and B starts
// after o-1.
func TestShutdownDuringFetchBackoffStopsWorkersBeforeRebalance(t *testing.T) {
	defer kafka.SetFetchBackoffFloor(time.Hour)() // not parallel: the floor is global
	addrs := cluster(t, 1, "orders", "other", "gone")
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "o", 0, 2)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	holdO1 := func(_ *idem.EventHandler, rec *idem.Record, _ idem.Outcome) {
		var ev order
		if json.Unmarshal(rec.Value, &ev) == nil && ev.EventID == "o-1" {
			close(entered)
			<-release
		}
	}
	fast := []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond)}
	logsA := &capture{}
	a := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "bshut", CommitInterval: 100 * time.Millisecond,
		Logger: slog.New(logsA), OnRecord: holdO1, ClientOpts: fast,
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder),
			topicConsumer("other", "billing", applyOrder), topicConsumer("gone", "billing", applyOrder)}}, nil)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("A's OnRecord never reached o-1")
	}
	// Deleted and re-created: A's fetches of it answer UNKNOWN_TOPIC_ID
	// (a topic only deleted is dropped from the fetches, without an error).
	adm := outsiderProducer(t, addrs)
	kmsgDeleteTopic(t, adm, "gone")
	kmsgCreateTopic(t, adm, "gone", 1)
	// Logged after the poll's exit check, before the backoff: from here a
	// cancellation ends the backoff, not a poll.
	waitBounded(t, 30*time.Second, "A's fetches of gone failing", func() bool { return logsA.has("fetch error", "topic=gone") })
	a.stop()
	waitBounded(t, 30*time.Second, "A's shutdown to take its orders/0 worker", func() bool {
		_, _, _, _, ok := kafka.WorkerHolds(a.c, "orders", 0)
		return !ok
	})
	var outB outcomes
	logsB := &capture{}
	b := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "bshut", CommitInterval: 100 * time.Millisecond,
		Logger: slog.New(logsB), ClientOpts: fast,
		Handlers: []idem.EventHandler{topicConsumer("orders", "billing", applyOrder)}}, &outB)
	// A revoke of orders/0 now would run while A's worker has yet to mark
	// o-1. With rebalances blocked none comes; B's join waits. Given the
	// time a revoke takes to come when allowed (B's join, A's heartbeat
	// every 100ms: well under a second), a bounded look.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && !logsA.has("partitions revoked", "orders") {
		time.Sleep(20 * time.Millisecond)
	}
	if logsA.has("partitions revoked", "orders") {
		t.Errorf("A revoked orders/0 while its shutdown still waited for the partition's worker")
	}
	free()
	select {
	case err := <-a.done:
		if err != nil {
			t.Errorf("A's Run: %v", err)
		}
		a.done <- nil
	case <-time.After(30 * time.Second):
		t.Fatal("A's Run did not return 30s after its worker was released")
	}
	produceTopic(t, cl, "orders", 0, "o", 2, 1)
	waitBounded(t, 30*time.Second, "B applies o-2", func() bool { return appliedCount(t, pool, "o") == 3 })
	waitBounded(t, 15*time.Second, "orders/0 committed to its end", func() bool { return committedIs(t, addrs, "bshut", 1, map[int32]int64{0: 3}) })
	b.shutdown(t)
	if d := outB.get(idem.Duplicate); d != 0 {
		t.Errorf("B met %d duplicate(s) (o-1, applied and to be marked by A's worker): A's revoke committed before the worker stopped", d)
	}
	wantAppliedInOrder(t, pool, "o", 3)
}
