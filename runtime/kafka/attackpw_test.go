package kafka_test

// Outside attacks on the per-partition workers (branch partworkers): pause
// and resume churn, rebalances while paused, handlers that ignore their
// context, Goexit while paused, leaks, memory, shutdown.

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// topicConsumer is orderConsumer on any topic, in context ctxName.
func topicConsumer(topic, ctxName string, fn func(context.Context, pgx.Tx, order) error) idem.EventHandler {
	return idem.Consume(idem.EventSpec[order]{
		Topic: topic, Context: ctxName,
		EventID: func(o order) string { return o.EventID },
	}, fn)
}

// produceTopic produces prefix-from .. prefix-(from+n-1) to topic/partition.
func produceTopic(t testing.TB, cl *kgo.Client, topic string, partition int32, prefix string, from, n int) {
	t.Helper()
	var recs []*kgo.Record
	for i := from; i < from+n; i++ {
		r := orderRecord(topic, order{EventID: fmt.Sprintf("%s-%d", prefix, i), Amount: int64(i)})
		r.Partition = partition
		recs = append(recs, r)
	}
	produce(t, cl, recs...)
}

// produceTopicBG is produceTopic for a goroutine other than the test's: a
// failure is reported with t.Error.
func produceTopicBG(t testing.TB, cl *kgo.Client, topic string, partition int32, prefix string, from, n int) {
	var recs []*kgo.Record
	for i := from; i < from+n; i++ {
		r := orderRecord(topic, order{EventID: fmt.Sprintf("%s-%d", prefix, i), Amount: int64(i)})
		r.Partition = partition
		recs = append(recs, r)
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Errorf("produce: %v", err)
	}
}

func manualProducer(t testing.TB, addrs []string) *kgo.Client {
	t.Helper()
	// Batches of about 1 KB (some 15 records): a consumer fetching one
	// batch per partition (FetchMaxPartitionBytes 1) gets a backlog in
	// many deliveries, so a slow worker is behind and paused again and
	// again.
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchMaxBytes(1024))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// appliedCount returns how many effects rows have an event id starting
// with prefix-.
func appliedCount(t testing.TB, pool *pgxpool.Pool, prefix string) int64 {
	t.Helper()
	return count(t, pool, `SELECT count(*) FROM effects WHERE event_id LIKE $1`, prefix+"-%")
}

// A runtime.Goexit in OnRecord for a partition that is paused (its worker
// busy with a backlog, more queued). The partition is rewound to its first
// record not marked and resumed; every record ends applied once, in order,
// and committed.
func TestAttackPWGoexitInOnRecordWhilePaused(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceTo(t, addrs, 0, "g0", 0, 200)
	produceTo(t, addrs, 1, "g1", 0, 50)
	var c *kafka.Consumer
	var exited atomic.Int32
	var sawPaused atomic.Bool
	var cref atomic.Pointer[kafka.Consumer]
	onRecord := func(h *idem.EventHandler, rec *idem.Record, o idem.Outcome) {
		if rec.Partition != 0 || rec.Offset < 20 || exited.Load() >= 3 {
			return
		}
		cc := cref.Load()
		if cc == nil {
			return
		}
		_, queued, _, paused, _ := kafka.WorkerHolds(cc, "orders", 0)
		if paused && queued > 0 && rec.Offset%7 == 0 {
			sawPaused.Store(true)
			exited.Add(1)
			runtime.Goexit()
		}
	}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "gxp", MaxPollRecords: 5, CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", func(ctx context.Context, tx pgx.Tx, ev order) error {
			if strings.HasPrefix(ev.EventID, "g0-") {
				time.Sleep(2 * time.Millisecond) // slow: a backlog builds, the partition is paused
			}
			return applyOrder(ctx, tx, ev)
		})},
		OnRecord:   onRecord,
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxPartitionBytes(1)}}
	var err error
	c, err = kafka.NewConsumer(idem.NewStore(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cref.Store(c)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitBounded(t, 15*time.Second, "the group joined (it exists before offsets are asked)", func() bool {
		_, _, _, _, ok := kafka.WorkerHolds(c, "orders", 1)
		return ok
	})
	waitBounded(t, 30*time.Second, "every record committed", func() bool {
		return committedIs(t, addrs, "gxp", 2, map[int32]int64{0: 200, 1: 50})
	})
	if !sawPaused.Load() {
		t.Fatal("no Goexit happened while the partition was paused; the test proves nothing")
	}
	t.Logf("Goexits while paused: %d", exited.Load())
	wantAppliedInOrder(t, pool, "g0", 200)
	wantAppliedInOrder(t, pool, "g1", 50)
}

// pauseChurn is one run of TestAttackPWPauseChurn.
type pauseChurn struct {
	name      string
	batch     int
	ledger    bool // a second handler on the topic, in context "ledger"
	maxPoll   int
	backlog   int // records on partition 0 before the consumer starts
	streamed  int // records on partition 0 produced while it runs
	sideCount int // records on partitions 1 and 2 each, produced while it runs
}

// Partition 0 has a backlog and a slow handler; MaxPollRecords is small, so
// its worker is behind on nearly every poll and the partition is paused and
// resumed hundreds of times, while records keep arriving on all three
// partitions. Throughout, no committed offset passes a record not applied
// (checked against the effects table many times while it runs); at the end
// every record is applied exactly once, in order, by every handler, and the
// committed offsets are the log ends.
func TestAttackPWPauseChurn(t *testing.T) {
	for _, tc := range []pauseChurn{
		{name: "batch1", batch: 1, maxPoll: 7, backlog: 300, streamed: 600, sideCount: 200},
		{name: "batch4", batch: 4, maxPoll: 9, backlog: 300, streamed: 900, sideCount: 200},
		{name: "twoHandlers", batch: 1, ledger: true, maxPoll: 7, backlog: 200, streamed: 400, sideCount: 150},
		{name: "twoHandlersBatch3", batch: 3, ledger: true, maxPoll: 8, backlog: 200, streamed: 400, sideCount: 150},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testPauseChurn(t, tc)
		})
	}
}

func testPauseChurn(t *testing.T, tc pauseChurn) {
	addrs := cluster(t, 3, "orders")
	pool := db(t)
	cl := manualProducer(t, addrs)
	produceTopic(t, cl, "orders", 0, "c0", 0, tc.backlog)
	slow := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if strings.HasPrefix(ev.EventID, "c0-") {
			time.Sleep(time.Millisecond)
		}
		return applyOrder(ctx, tx, ev)
	}
	handlers := []idem.EventHandler{orderConsumer("orders", slow)}
	if tc.ledger {
		handlers = append(handlers, topicConsumer("orders", "ledger", func(ctx context.Context, tx pgx.Tx, ev order) error {
			ev.EventID = "L/" + ev.EventID
			return applyOrder(ctx, tx, ev)
		}))
	}
	group := "churn-" + tc.name
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: tc.maxPoll,
		BatchSize: tc.batch, CommitInterval: 100 * time.Millisecond, Handlers: handlers,
		ClientOpts: []kgo.Opt{kgo.FetchMaxPartitionBytes(1)}}, nil) // one batch per delivery: pause churn

	waitBounded(t, 15*time.Second, "the consumer to join and start partition 0", func() bool {
		_, _, _, _, ok := kafka.WorkerHolds(r.c, "orders", 0)
		return ok
	})
	// Producers: partition 0 in chunks of 25, partitions 1 and 2 in chunks of 10.
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; i < tc.streamed; i += 25 {
			produceTopicBG(t, cl, "orders", 0, "c0", tc.backlog+i, min(25, tc.streamed-i))
		}
	})
	for p := int32(1); p <= 2; p++ {
		wg.Go(func() {
			for i := 0; i < tc.sideCount; i += 10 {
				produceTopicBG(t, cl, "orders", p, fmt.Sprintf("c%d", p), i, min(10, tc.sideCount-i))
			}
		})
	}

	// Watch: committed offsets never ahead of what was applied; count the
	// pauses seen.
	want := map[int32]int64{0: int64(tc.backlog + tc.streamed), 1: int64(tc.sideCount), 2: int64(tc.sideCount)}
	var pauses, checks int
	wasPaused := false
	// Fails on a stall, not on a slow machine: 30s with no record applied
	// and no offset committed on any partition (the CI machine, 2 cores
	// under every package's tests, applied 578 of 600 here in 60s while
	// progressing), or past a generous cap.
	progress, last := int64(-1), time.Now()
	capAt := time.Now().Add(5 * time.Minute)
	for {
		committed := committedOffsets(t, addrs, group, "orders", 3)
		for p := int32(0); p < 3; p++ {
			prefix := fmt.Sprintf("c%d", p)
			applied := appliedCount(t, pool, prefix)
			if committed[p] > applied {
				t.Fatalf("partition %d committed at %d with only %d records applied", p, committed[p], applied)
			}
			if tc.ledger {
				if l := appliedCount(t, pool, "L/"+prefix); committed[p] > l {
					t.Fatalf("partition %d committed at %d with only %d records applied by the second handler", p, committed[p], l)
				}
			}
		}
		checks++
		_, _, _, paused, _ := kafka.WorkerHolds(r.c, "orders", 0)
		if paused && !wasPaused {
			pauses++
		}
		wasPaused = paused
		if committed[0] == want[0] && committed[1] == want[1] && committed[2] == want[2] {
			break
		}
		if n := committed[0] + committed[1] + committed[2] + count(t, pool, `SELECT count(*) FROM effects`); n != progress {
			progress, last = n, time.Now()
		}
		if stalled := time.Since(last) > 30*time.Second; stalled || time.Now().After(capAt) {
			t.Fatalf("no progress for 30s (%v) or past 5m: committed %v, want %v; applied c0 %d",
				stalled, committed, want, appliedCount(t, pool, "c0"))
		}
	}
	wg.Wait()
	r.shutdown(t)
	t.Logf("%d checks, partition 0 seen newly paused %d times", checks, pauses)
	if pauses < 5 {
		t.Errorf("partition 0 seen paused only %d times: the churn this test is about did not happen", pauses)
	}
	for p := int32(0); p < 3; p++ {
		prefix := fmt.Sprintf("c%d", p)
		wantAppliedInOrder(t, pool, prefix, int(want[p]))
		if tc.ledger {
			wantAppliedInOrder(t, pool, "L/"+prefix, int(want[p]))
		}
	}
	handlersN := int64(1)
	if tc.ledger {
		handlersN = 2
	}
	total := want[0] + want[1] + want[2]
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != total*handlersN {
		t.Fatalf("%d processed-event rows, want %d", n, total*handlersN)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

// Three members, members leaving and joining eight times while partition 0
// is slow and paused behind a backlog, and one record of partition 0 is
// stuck (its handler waits for its context: a revoke rolls it back), and one
// record of partition 3 fails twice (retry backoff), records arriving all
// the while. With the cooperative-sticky balancer (kgo's default) and with
// an eager one (range). At the end every record is applied exactly once,
// in order per partition (effects table and processed-event rows), nothing
// dead-lettered, and the committed offsets are the log ends.
func TestAttackPWRebalanceChurnWhilePaused(t *testing.T) {
	for _, bal := range []struct {
		name string
		opt  kgo.GroupBalancer
	}{{"cooperative", nil}, {"eager", kgo.RangeBalancer()}} {
		t.Run(bal.name, func(t *testing.T) {
			t.Parallel()
			testRebalanceChurn(t, bal.name, bal.opt)
		})
	}
}

func testRebalanceChurn(t *testing.T, name string, balancer kgo.GroupBalancer) {
	const parts, pre, streamed = 6, 60, 140
	addrs := cluster(t, parts, "orders")
	pool := db(t)
	cl := manualProducer(t, addrs)
	for p := range int32(parts) {
		produceTopic(t, cl, "orders", p, fmt.Sprintf("q%d", p), 0, pre)
	}
	release := make(chan struct{})
	var stuckOnce atomic.Bool
	var fails atomic.Int32
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		switch {
		case ev.EventID == "q0-70" && stuckOnce.CompareAndSwap(false, true):
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		case ev.EventID == "q3-90" && fails.Add(1) <= 2:
			return fmt.Errorf("q3-90 fails (%d)", fails.Load())
		case strings.HasPrefix(ev.EventID, "q0-"):
			time.Sleep(time.Millisecond)
		}
		return applyOrder(ctx, tx, ev)
	}
	group := "rchurn-" + name
	var out outcomes
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: 6, CommitInterval: 100 * time.Millisecond,
		Retry:    idem.RetryPolicy{MaxAttempts: 10, Initial: 50 * time.Millisecond, Max: 100 * time.Millisecond},
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)}}
	if balancer != nil {
		cfg.ClientOpts = []kgo.Opt{kgo.Balancers(balancer)}
	}
	type member struct {
		r    *running
		logs *capture
	}
	start := func() member {
		logs := &capture{}
		c := cfg
		c.Logger = slog.New(logs)
		return member{r: startConsumer(t, pool, c, &out), logs: logs}
	}
	members := []member{start(), start(), start()}
	var wg sync.WaitGroup
	wg.Go(func() { streamOrders(t, cl, "q", parts, pre, streamed) })
	total := func() int64 { return count(t, pool, `SELECT count(*) FROM effects`) }
	for i := range 8 {
		before := total()
		// Leave: the oldest member; join: a new one, once it has a partition.
		members[0].r.shutdown(t)
		m := start()
		members = append(members[1:], m)
		waitBounded(t, 30*time.Second, fmt.Sprintf("churn %d: the new member assigned", i), func() bool {
			return m.logs.has("partitions assigned", "orders:[")
		})
		waitBounded(t, 30*time.Second, fmt.Sprintf("churn %d: progress", i), func() bool {
			// Partition 0 may stay stuck on q0-70 (not moved): then the
			// others finishing is all the progress there is.
			return total() > before ||
				count(t, pool, `SELECT count(*) FROM effects WHERE event_id NOT LIKE 'q0-%'`) == (parts-1)*(pre+streamed)
		})
	}
	wg.Wait()
	close(release)
	want := map[int32]int64{}
	for p := range int32(parts) {
		want[p] = pre + streamed
	}
	waitBounded(t, 60*time.Second, "every record committed", func() bool {
		return committedIs(t, addrs, group, parts, want)
	})
	for _, m := range members {
		m.r.shutdown(t)
	}
	for p := range int32(parts) {
		wantAppliedInOrder(t, pool, fmt.Sprintf("q%d", p), pre+streamed)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != parts*(pre+streamed) {
		t.Fatalf("%d processed-event rows, want %d", n, parts*(pre+streamed))
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	t.Logf("outcomes: applied %d, duplicate %d; q0-70 stuck once: %v", out.get(idem.Applied), out.get(idem.Duplicate), stuckOnce.Load())
}

// Partitions moving back and forth: member A stays, member B joins and
// leaves six times, so A's partitions go to B and come back while A's
// workers are paused behind a slow backlog; records keep arriving. A
// partition coming back must not stay paused (kgo keeps a pause across
// rebalances) and nothing may be lost or applied twice.
func TestAttackPWPartitionsMoveBackAndForthWhilePaused(t *testing.T) {
	for _, bal := range []struct {
		name string
		opt  kgo.GroupBalancer
	}{{"cooperative", nil}, {"eager", kgo.RangeBalancer()}} {
		t.Run(bal.name, func(t *testing.T) {
			t.Parallel()
			const parts, pre, streamed = 4, 150, 150
			addrs := cluster(t, parts, "orders")
			pool := db(t)
			cl := manualProducer(t, addrs)
			for p := range int32(parts) {
				produceTopic(t, cl, "orders", p, fmt.Sprintf("b%d", p), 0, pre)
			}
			slow := func(ctx context.Context, tx pgx.Tx, ev order) error {
				time.Sleep(time.Millisecond) // slow: the backlog keeps partitions paused
				return applyOrder(ctx, tx, ev)
			}
			group := "backforth-" + bal.name
			cfg := kafka.ConsumerConfig{Brokers: addrs, Group: group, MaxPollRecords: 5, CommitInterval: 100 * time.Millisecond,
				Handlers:   []idem.EventHandler{orderConsumer("orders", slow)},
				ClientOpts: []kgo.Opt{kgo.FetchMaxPartitionBytes(1)}} // one batch per delivery
			if bal.opt != nil {
				cfg.ClientOpts = append(cfg.ClientOpts, kgo.Balancers(bal.opt))
			}
			logsA := &capture{}
			cfgA := cfg
			cfgA.Logger = slog.New(logsA)
			a := startConsumer(t, pool, cfgA, nil)
			waitBounded(t, 15*time.Second, "A paused behind its backlog", func() bool {
				_, _, _, paused, _ := kafka.WorkerHolds(a.c, "orders", 0)
				return paused
			})
			var wg sync.WaitGroup
			wg.Go(func() { streamOrders(t, cl, "b", parts, pre, streamed) })
			total := func() int64 { return count(t, pool, `SELECT count(*) FROM effects`) }
			for i := range 6 {
				logsB := &capture{}
				cfgB := cfg
				cfgB.Logger = slog.New(logsB)
				before := total()
				b := startConsumer(t, pool, cfgB, nil)
				waitBounded(t, 30*time.Second, fmt.Sprintf("move %d: B assigned", i), func() bool {
					return logsB.has("partitions assigned", "orders:[")
				})
				waitBounded(t, 30*time.Second, fmt.Sprintf("move %d: progress", i), func() bool {
					return total() > before || total() == parts*(pre+streamed)
				})
				b.shutdown(t)
			}
			wg.Wait()
			want := map[int32]int64{}
			for p := range int32(parts) {
				want[p] = pre + streamed
			}
			waitBounded(t, 60*time.Second, "A finishes every partition after the last move", func() bool {
				return committedIs(t, addrs, group, parts, want)
			})
			for p := range int32(parts) {
				if _, _, _, paused, ok := kafka.WorkerHolds(a.c, "orders", p); ok && paused {
					t.Errorf("partition %d still paused on A with nothing left", p)
				}
			}
			a.shutdown(t)
			for p := range int32(parts) {
				wantAppliedInOrder(t, pool, fmt.Sprintf("b%d", p), pre+streamed)
			}
			if n := count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != parts*(pre+streamed) {
				t.Fatalf("%d processed-event rows, want %d", n, parts*(pre+streamed))
			}
		})
	}
}

// streamOrders produces streamed more records to each of parts partitions of
// "orders", ten at a time round the partitions, with event ids
// <prefix><partition>-<n> from pre on.
func streamOrders(t *testing.T, cl *kgo.Client, prefix string, parts, pre, streamed int) {
	for i := 0; i < streamed; i += 10 {
		for p := range int32(parts) {
			produceTopicBG(t, cl, "orders", p, fmt.Sprintf("%s%d", prefix, p), pre+i, 10)
		}
	}
}
