package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// PostgreSQL goes down for a few seconds while partition 0 is stuck retrying
// a poison record (its handler always fails: five attempts with backoff,
// then a dead letter) and partitions 1 and 2 flow with a backlog (paused
// and resumed). Afterwards: the poison record dead-lettered once, every other
// record applied once in order, committed offsets at the log ends.
func TestAttackPWDBDownWhilePoisonStuck(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 3, "orders")
	direct, proxied, px := faultDB(t)
	cl := manualProducer(t, addrs)
	for p := range int32(3) {
		produceTopic(t, cl, "orders", p, fmt.Sprintf("d%d", p), 0, 100)
	}
	var poisonTries atomic.Int32
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "d0-5" {
			poisonTries.Add(1)
			return errors.New("poison")
		}
		return applyOrder(ctx, tx, ev)
	}
	logs := &capture{}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "dbpoison", MaxPollRecords: 7, CommitInterval: 100 * time.Millisecond,
		Retry:  idem.RetryPolicy{MaxAttempts: 5, Initial: 300 * time.Millisecond, Max: 300 * time.Millisecond},
		Outage: idem.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}, StorageTimeout: time.Second,
		Logger:   slog.New(logs),
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)}}
	r := startConsumer(t, proxied, cfg, nil)
	waitBounded(t, 15*time.Second, "the poison record tried", func() bool { return poisonTries.Load() >= 1 })
	px.Down()
	for p := int32(1); p < 3; p++ {
		produceTopic(t, cl, "orders", p, fmt.Sprintf("d%d", p), 100, 50)
	}
	produceTopic(t, cl, "orders", 0, "d0", 100, 50)
	waitBounded(t, 15*time.Second, "the outage noticed", func() bool {
		return logs.has("storage unavailable")
	})
	waitBounded(t, 15*time.Second, "partitions 1 and 2 paused behind the outage", func() bool {
		_, _, _, p1, _ := kafka.WorkerHolds(r.c, "orders", 1)
		_, _, _, p2, _ := kafka.WorkerHolds(r.c, "orders", 2)
		return p1 && p2
	})
	px.Restore()
	waitBounded(t, 30*time.Second, "every record committed", func() bool {
		return committedIs(t, addrs, "dbpoison", 3, map[int32]int64{0: 150, 1: 150, 2: 150})
	})
	r.shutdown(t)
	if n := count(t, direct, `SELECT count(*) FROM idem_dead_letters`); n != 1 {
		t.Fatalf("%d dead letters, want 1 (d0-5)", n)
	}
	var want []string
	for i := range 150 {
		if i != 5 {
			want = append(want, fmt.Sprintf("d0-%d", i))
		}
	}
	if got := appliedIDs(t, direct, "d0"); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("partition 0 applied %v, want %v", got, want)
	}
	wantAppliedInOrder(t, direct, "d1", 150)
	wantAppliedInOrder(t, direct, "d2", 150)
}

// Shutdown while one partition waits out a database outage (its record in
// hand) and the others have done records whose marks are not committed yet
// (CommitInterval one minute): Run returns within a bound, the done records'
// offsets are committed by the shutdown, the waiting partition's offset is
// not past its record.
func TestAttackPWShutdownDuringOutageCommitsDoneMarks(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	direct, proxied, px := faultDB(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 1, "m1", 0, 20)
	entered, release := make(chan struct{}), make(chan struct{})
	var held atomic.Bool
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "m0-3" && held.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return applyOrder(ctx, tx, ev)
	}
	logs := &capture{}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "shutout", MaxPollRecords: 5, CommitInterval: time.Minute,
		Outage: idem.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}, StorageTimeout: time.Second,
		Logger:   slog.New(logs),
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)}}
	r := startConsumer(t, proxied, cfg, nil)
	waitBounded(t, 15*time.Second, "partition 1 applied", func() bool { return appliedCount(t, direct, "m1") == 20 })
	produceTopic(t, cl, "orders", 0, "m0", 0, 10)
	<-entered
	px.Down()
	close(release)
	waitBounded(t, 15*time.Second, "the outage wait", func() bool { return logs.has("storage unavailable") })
	start := time.Now()
	r.shutdown(t)
	took := time.Since(start)
	px.Restore()
	if took > 3*time.Second {
		t.Errorf("shutdown took %v with a partition in an outage wait", took)
	}
	got := committedOffsets(t, addrs, "shutout", "orders", 2)
	if got[1] != 20 || got[0] != 3 {
		t.Fatalf("committed %v after shutdown, want partition 0 at 3 (its record in the outage wait), 1 at 20 (done, marks not yet committed)", got)
	}
	t.Logf("shutdown took %v", took)
}

// After Run returns, none of the consumer's goroutines remain: no
// partition worker, no lane goroutine, no kgo goroutine. Run with partitions
// in every state: one stuck (handler waiting for its context), one in
// retry backoff, one paused behind a backlog, one whose worker ended by a
// Goexit in OnRecord. Not parallel: it counts goroutines by their stacks.
func TestAttackPWNoGoroutineLeftAfterRun(t *testing.T) {
	addrs := cluster(t, 4, "orders")
	pool := db(t)
	cl := manualProducer(t, addrs)
	// Partition 2 in batches of 10, fetched one batch at a time
	// (FetchMaxPartitionBytes 1): its slow worker is behind with 5 or more
	// queued, so its partition is paused.
	for p := range int32(4) {
		for i := 0; i < 60; i += 10 {
			produceTopic(t, cl, "orders", p, fmt.Sprintf("k%d", p), i, 10)
		}
	}
	var stuck, backoff, exited atomic.Bool
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		switch ev.EventID {
		case "k0-2":
			stuck.Store(true)
			<-ctx.Done()
			return ctx.Err()
		case "k1-2":
			backoff.Store(true)
			return errors.New("later")
		}
		if strings.HasPrefix(ev.EventID, "k2-") {
			time.Sleep(5 * time.Millisecond)
		}
		return applyOrder(ctx, tx, ev)
	}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{Brokers: addrs, Group: "leak", MaxPollRecords: 5,
		Retry:    idem.RetryPolicy{MaxAttempts: 5, Initial: time.Hour, Max: time.Hour},
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		OnRecord: func(_ *idem.EventHandler, rec *idem.Record, _ idem.Outcome) {
			if rec.Partition == 3 && rec.Offset == 4 && exited.CompareAndSwap(false, true) {
				runtime.Goexit()
			}
		},
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxPartitionBytes(1)}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel) // a failed wait below must not leave Run running
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitBounded(t, 15*time.Second, "every state reached", func() bool {
		_, _, _, paused, _ := kafka.WorkerHolds(c, "orders", 2)
		return stuck.Load() && backoff.Load() && exited.Load() && paused
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return")
	}
	ours := func() []string {
		buf := make([]byte, 1<<22)
		buf = buf[:runtime.Stack(buf, true)]
		var left []string
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "idemgen/runtime/kafka.") || strings.Contains(g, "guardlane") ||
				strings.Contains(g, "idemgen/runtime/idem.") ||
				(strings.Contains(g, "franz-go/pkg/kgo.") && !strings.Contains(g, "kfake")) {
				if strings.Contains(g, "kafka_test.producer") || strings.Contains(g, "testing.tRunner") {
					continue
				}
				left = append(left, g)
			}
		}
		return left
	}
	// The test's own producer client is a kgo client too: close it first.
	cl.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		left := ours()
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines left 10s after Run returned:\n%s", len(left), strings.Join(left, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Memory while many partitions are stuck at once (a database outage stalls
// every partition's worker on its record in hand) and producers keep
// filling them. Each worker holds at most what it took (one poll's
// delivery for the partition: the part of one fetch response), fewer than
// MaxPollRecords queued, and one more delivery: a behind worker's
// partition is paused once MaxPollRecords or more are queued. Here each
// fetch carries one 100-record batch. This measures the sum, which grows
// with the partitions. It fails if the per-partition bound is broken and
// logs the sum.
func TestAttackPWMemoryManyStuckPartitions(t *testing.T) {
	t.Parallel()
	const parts, maxPoll = 16, 50
	addrs := cluster(t, parts, "orders")
	pool := db(t)
	cl := manualProducer(t, addrs)
	release := make(chan struct{})
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return applyOrder(ctx, tx, ev)
	}
	// One 100-record batch per fetch (FetchMaxPartitionBytes 1): a worker
	// holds the batch it took, and fewer than MaxPollRecords queued plus
	// one more batch.
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "mem", MaxPollRecords: maxPoll,
		Handlers:   []idem.EventHandler{orderConsumer("orders", handler)},
		ClientOpts: []kgo.Opt{kgo.FetchMaxPartitionBytes(1)}}, nil)
	for round := range 4 {
		for p := range int32(parts) {
			produceTopic(t, cl, "orders", p, fmt.Sprintf("y%d", p), round*100, 100)
		}
	}
	held := func() (sum, maxOne int, allPaused bool) {
		allPaused = true
		for p := range int32(parts) {
			taken, queued, _, paused, ok := kafka.WorkerHolds(r.c, "orders", p)
			if !ok || !paused {
				allPaused = false
			}
			sum += taken + queued
			maxOne = max(maxOne, taken+queued)
		}
		return
	}
	waitBounded(t, 30*time.Second, "every partition paused behind its stuck worker", func() bool {
		_, _, all := held()
		return all
	})
	sum, maxOne, _ := held()
	t.Logf("records held by the workers of %d stuck partitions: %d (max %d in one); MaxPollRecords %d",
		parts, sum, maxOne, maxPoll)
	if bound := 100 + maxPoll - 1 + 100; maxOne > bound {
		t.Errorf("one worker holds %d records, more than %d (a batch taken, MaxPollRecords-1 and a batch queued)", maxOne, bound)
	}
	close(release)
	want := map[int32]int64{}
	for p := range int32(parts) {
		want[p] = 400
	}
	waitCommitted(t, addrs, "mem", parts, want, "every record", nil)
}

// The consumed topic is deleted and re-created while its partition 0 is
// stuck on a record (a handler waiting for its context) and paused behind a
// backlog, and partition 1 flows. With other, when set, a second topic
// that keeps delivering records all the while. The re-created topic's
// records must be applied, on both partitions.
func TestAttackPWTopicRecreatedWhilePaused(t *testing.T) {
	for _, other := range []bool{false, true} {
		t.Run(fmt.Sprint("otherTopicFlowing=", other), func(t *testing.T) {
			t.Parallel()
			testTopicRecreatedWhilePaused(t, other)
		})
	}
}

func testTopicRecreatedWhilePaused(t *testing.T, other bool) {
	addrs := cluster(t, 2, "orders", "other")
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "old0", 0, 40)
	produceTopic(t, cl, "orders", 1, "old1", 0, 10)
	var stuck atomic.Bool
	handler := stuckUntilCancelled("old0-2", &stuck)
	logs := &capture{}
	group := fmt.Sprint("recreate-", other)
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: 5,
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs),
		ClientOpts: []kgo.Opt{kgo.FetchMaxPartitionBytes(1)}, // one batch per delivery
		Handlers:   []idem.EventHandler{orderConsumer("orders", handler), topicConsumer("other", "billing", applyOrder)}}, nil)
	waitBounded(t, 15*time.Second, "partition 0 stuck and paused", func() bool {
		_, _, _, paused, _ := kafka.WorkerHolds(r.c, "orders", 0)
		return stuck.Load() && paused && appliedCount(t, pool, "old1") == 10
	})
	stopOther := make(chan struct{})
	otherDone := make(chan struct{})
	go func() {
		defer close(otherDone)
		if !other {
			return
		}
		for i := 0; ; i += 5 {
			select {
			case <-stopOther:
				return
			default:
			}
			produceTopicBG(t, cl, "other", 0, "x", i, 5)
			time.Sleep(20 * time.Millisecond) // a steady trickle, not a wait
		}
	}()
	defer func() { close(stopOther); <-otherDone }()
	fresh := recreateTopic(t, addrs, "orders", 2)
	produceTopic(t, fresh, "orders", 0, "new0", 0, 10)
	produceTopic(t, fresh, "orders", 1, "new1", 0, 10)
	deadline := time.Now().Add(30 * time.Second)
	for appliedCount(t, pool, "new0") < 10 || appliedCount(t, pool, "new1") < 10 {
		if time.Now().After(deadline) {
			_, q, busy, paused, ok := kafka.WorkerHolds(r.c, "orders", 0)
			t.Fatalf("30s after the topic was re-created: new0 %d/10, new1 %d/10 applied; orders/0 worker queued %d busy %v paused %v ok %v; recovered (log): %v",
				appliedCount(t, pool, "new0"), appliedCount(t, pool, "new1"), q, busy, paused, ok,
				logs.has("topic was deleted and re-created"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	wantAppliedInOrder(t, pool, "new0", 10)
	wantAppliedInOrder(t, pool, "new1", 10)
}

// fetchCounter counts the records kgo read from fetch responses.
type fetchCounter struct{ records, bytes atomic.Int64 }

func (f *fetchCounter) OnFetchBatchRead(_ kgo.BrokerMetadata, _ string, _ int32, m kgo.FetchBatchMetrics) {
	f.records.Add(int64(m.NumRecords))
	f.bytes.Add(int64(m.UncompressedBytes))
}

// How many records the client fetches from the broker to apply a backlog on
// one partition with a slow handler. Polling MaxPollRecords at a time, each
// pause dropped what kgo had buffered for the partition beyond the poll's
// records, and the resume fetched it again (109× at MaxPollRecords 10, 10×
// at 100). Polling everything kgo buffered, a pause drops at most the
// partition's part of a fetch in flight. With FetchMaxPartitionBytes 4 KB
// each fetch carries one 200-record batch, so the worker is behind and its
// partition paused and resumed again and again (the test sees it paused).
func TestAttackPWPauseRefetchAmplification(t *testing.T) {
	t.Parallel()
	for _, maxPoll := range []int{10, 100} {
		for _, partBytes := range []int32{0, 4 << 10} {
			t.Run(fmt.Sprintf("maxPoll%d/partBytes%d", maxPoll, partBytes), func(t *testing.T) {
				t.Parallel()
				const n = 2000
				addrs := cluster(t, 1, "orders")
				pool := db(t)
				cl := manualProducer(t, addrs)
				for i := 0; i < n; i += 200 {
					produceTopic(t, cl, "orders", 0, "a", i, 200)
				}
				var fc fetchCounter
				group := fmt.Sprint("amp", maxPoll, "_", partBytes)
				opts := []kgo.Opt{kgo.WithHooks(&fc)}
				if partBytes > 0 {
					opts = append(opts, kgo.FetchMaxPartitionBytes(partBytes))
				}
				r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: maxPoll,
					CommitInterval: 100 * time.Millisecond,
					Handlers:       []idem.EventHandler{orderConsumer("orders", applyOrder)},
					ClientOpts:     opts}, nil)
				waitBounded(t, 15*time.Second, "the worker started", func() bool {
					_, _, _, _, ok := kafka.WorkerHolds(r.c, "orders", 0)
					return ok
				})
				sawPaused := false
				waitCommitted(t, addrs, group, 1, map[int32]int64{0: n}, "every record committed", func() {
					_, _, _, paused, _ := kafka.WorkerHolds(r.c, "orders", 0)
					sawPaused = sawPaused || paused
				})
				r.shutdown(t)
				wantAppliedInOrder(t, pool, "a", n)
				factor := float64(fc.records.Load()) / n
				t.Logf("MaxPollRecords %d, FetchMaxPartitionBytes %d: fetched %d records (%d bytes) to apply %d: %.1f×; seen paused: %v",
					maxPoll, partBytes, fc.records.Load(), fc.bytes.Load(), n, factor, sawPaused)
				if factor > 3 {
					t.Errorf("fetched %.1f× the records applied; want at most 3×", factor)
				}
				if partBytes > 0 && !sawPaused {
					t.Errorf("the partition was never seen paused: the test did not exercise a pause")
				}
			})
		}
	}
}
