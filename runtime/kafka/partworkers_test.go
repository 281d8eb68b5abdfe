package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// produceTo produces the orders prefix-from .. prefix-(from+n-1) to one
// partition of "orders", in that order.
func produceTo(t *testing.T, addrs []string, partition int32, prefix string, from, n int) {
	t.Helper()
	// Batches of about 1 KB, as manualProducer's.
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchMaxBytes(1024))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := from; i < from+n; i++ {
		r := orderRecord("orders", order{EventID: fmt.Sprintf("%s-%d", prefix, i), Amount: int64(i)})
		r.Partition = partition
		recs = append(recs, r)
	}
	produce(t, cl, recs...)
}

// gate is a handler that blocks on the first call for one event id until
// released (or its context ends: the record then rolls back); every other
// call applies the order. entered is closed when it first blocks.
type gate struct {
	id       string
	blocked  atomic.Bool
	entered  chan struct{}
	release  chan struct{}
	released atomic.Bool
}

func newGate(id string) *gate {
	return &gate{id: id, entered: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) handle(ctx context.Context, tx pgx.Tx, ev order) error {
	if ev.EventID == g.id && g.blocked.CompareAndSwap(false, true) {
		close(g.entered)
		select {
		case <-g.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return applyOrder(ctx, tx, ev)
}

func (g *gate) open() {
	if g.released.CompareAndSwap(false, true) {
		close(g.release)
	}
}

func (g *gate) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(30 * time.Second):
		t.Fatalf("the handler never ran on %s", g.id)
	}
}

// appliedIDs returns the applied event ids starting with prefix, in the
// order they were applied.
func appliedIDs(t *testing.T, pool *pgxpool.Pool, prefix string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT event_id FROM effects WHERE event_id LIKE $1 ORDER BY id`, prefix+"-%")
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// wantAppliedInOrder fails unless the events prefix-0 .. prefix-(n-1) were
// each applied once, in that order.
func wantAppliedInOrder(t *testing.T, pool *pgxpool.Pool, prefix string, n int) {
	t.Helper()
	var want []string
	for i := range n {
		want = append(want, fmt.Sprintf("%s-%d", prefix, i))
	}
	if got := appliedIDs(t, pool, prefix); !slices.Equal(got, want) {
		t.Fatalf("applied %v, want %v (each once, in order)", got, want)
	}
}

// committedIs reports whether the group's committed offsets of "orders" are
// want.
func committedIs(t *testing.T, addrs []string, group string, partitions int32, want map[int32]int64) bool {
	t.Helper()
	got := committedOffsets(t, addrs, group, "orders", partitions)
	for p, o := range want {
		if got[p] != o {
			return false
		}
	}
	return true
}

// A handler stuck on one record of partition 0 (blocked until the test
// releases it) holds up only partition 0: partition 1's records, also those
// produced after partition 0 got stuck, are applied and their offsets
// committed, while partition 0's committed offset stays at its stuck
// record; the stuck partition is reported once (Warn, with its offset).
// Released, every record is applied once, in order per partition. Fails on
// the old consumer, whose poll waited for every partition's goroutine:
// partition 1 stopped with partition 0.
func TestStuckPartitionDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	defer kafka.SetStuckWarnAfter(300 * time.Millisecond)()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceTo(t, addrs, 0, "p0", 0, 10)
	produceTo(t, addrs, 1, "p1", 0, 10)
	g := newGate("p0-2")
	logs := &capture{}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "stuck", MaxPollRecords: 4,
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs),
		Handlers: []idem.EventHandler{orderConsumer("orders", g.handle)}}, nil)
	g.waitEntered(t)
	produceTo(t, addrs, 1, "p1", 10, 10)
	waitBounded(t, 15*time.Second, "partition 1's 20 records applied and committed while partition 0 is stuck", func() bool {
		return len(appliedIDs(t, pool, "p1")) == 20 && committedIs(t, addrs, "stuck", 2, map[int32]int64{0: 2, 1: 20})
	})
	if g.released.Load() || count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'p0-2'`) != 0 {
		t.Fatal("partition 0 was not stuck")
	}
	waitBounded(t, 10*time.Second, "the stuck partition reported", func() bool {
		return logs.has("partition stuck", "group=stuck", "topic=orders", "partition=0", "offset=2")
	})
	g.open()
	waitBounded(t, 15*time.Second, "every record after the release", func() bool {
		return committedIs(t, addrs, "stuck", 2, map[int32]int64{0: 10, 1: 20})
	})
	waitBounded(t, 10*time.Second, "the log that partition 0 moves again", func() bool {
		return logs.has("partition moving again", "partition=0")
	})
	r.shutdown(t)
	wantAppliedInOrder(t, pool, "p0", 10)
	wantAppliedInOrder(t, pool, "p1", 20)
}

// While partition 0 is stuck, records keep arriving on it: its worker holds
// at most the records it took plus fewer than MaxPollRecords queued and one
// more fetch's worth (FetchMaxPartitionBytes 1 makes each fetch carry one
// record batch, here of at most 8 records), and the partition is paused
// (kgo fetches nothing more for it). Released, all of them are applied
// once, in order: nothing fetched and dropped is lost.
func TestStuckPartitionBuffersBounded(t *testing.T) {
	t.Parallel()
	const maxPoll = 4
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceTo(t, addrs, 0, "b0", 0, 3)
	g := newGate("b0-1")
	c := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "bounded", MaxPollRecords: maxPoll,
		CommitInterval: 100 * time.Millisecond,
		Handlers:       []idem.EventHandler{orderConsumer("orders", g.handle)},
		ClientOpts:     []kgo.Opt{kgo.FetchMaxPartitionBytes(1)}}, nil)
	g.waitEntered(t)
	// Many polls' worth behind the stuck record, in several produce calls,
	// and traffic on partition 1 so that the poll loop keeps polling.
	for i := 3; i < 60; i += 8 {
		produceTo(t, addrs, 0, "b0", i, min(8, 60-i))
		produceTo(t, addrs, 1, "b1", i-3, 8)
	}
	waitBounded(t, 15*time.Second, "partition 1's records", func() bool { return len(appliedIDs(t, pool, "b1")) == 64 })
	var taken, queued int
	var busy, paused, ok bool
	waitBounded(t, 10*time.Second, "partition 0 paused behind its stuck worker", func() bool {
		taken, queued, busy, paused, ok = kafka.WorkerHolds(c.c, "orders", 0)
		return ok && paused && busy && queued > 0
	})
	// Watch it a while longer (partition 1 keeps being polled): the bound
	// holds; a worker holding every record fetched would show 60.
	for i := range 10 {
		produceTo(t, addrs, 1, "b1", 64+i, 1)
		taken, queued, busy, paused, ok = kafka.WorkerHolds(c.c, "orders", 0)
		if !ok || taken > 3 || queued > maxPoll-1+8 || !paused {
			t.Fatalf("partition 0's worker holds %d taken + %d queued (busy %v, paused %v, ok %v), want at most %d + %d, paused",
				taken, queued, busy, paused, ok, 3, maxPoll-1+8)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := len(appliedIDs(t, pool, "b0")); n != 1 {
		t.Fatalf("%d of partition 0's records applied while stuck, want 1", n)
	}
	g.open()
	waitBounded(t, 15*time.Second, "every record after the release", func() bool {
		return committedIs(t, addrs, "bounded", 2, map[int32]int64{0: 60, 1: 74})
	})
	c.shutdown(t)
	wantAppliedInOrder(t, pool, "b0", 60)
	wantAppliedInOrder(t, pool, "b1", 74)
}

// A second member joins while partition 0 is stuck. Cooperative rebalancing
// moves one partition: if it is partition 0, its worker is cancelled (the
// stuck record rolls back) and B applies it; if it is partition 1, B takes
// it over while A stays stuck on partition 0 until released. Either way the
// rebalance completes while the record is stuck, no offset is committed past
// it while it is not applied, and every record ends applied exactly once,
// in order per partition.
func TestRebalanceWhileStuck(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceTo(t, addrs, 0, "r0", 0, 10)
	produceTo(t, addrs, 1, "r1", 0, 10)
	g := newGate("r0-3")
	var a, b outcomes
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "rebal", MaxPollRecords: 4, CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", g.handle)}}
	ra := startConsumer(t, pool, cfg, &a)
	g.waitEntered(t)
	logsB := &capture{}
	cfg.Logger = slog.New(logsB)
	rb := startConsumer(t, pool, cfg, &b)
	waitBounded(t, 15*time.Second, "member B assigned a partition while A is stuck", func() bool {
		return logsB.has("partitions assigned", "orders:[")
	})
	produceTo(t, addrs, 0, "r0", 10, 5)
	produceTo(t, addrs, 1, "r1", 10, 5)
	// Until the stuck record is applied, partition 0's committed offset
	// stays at or before it.
	waitBounded(t, 15*time.Second, "partition 1's records", func() bool {
		stuckDone := count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'r0-3'`) > 0
		if off := committedOffsets(t, addrs, "rebal", "orders", 2)[0]; !stuckDone && off > 3 {
			t.Fatalf("partition 0 committed at %d, past its record at offset 3 not applied", off)
		}
		return len(appliedIDs(t, pool, "r1")) == 15
	})
	waitBounded(t, 15*time.Second, "member B to apply records", func() bool { return b.total() > 0 })
	g.open()
	waitBounded(t, 15*time.Second, "every record", func() bool {
		return committedIs(t, addrs, "rebal", 2, map[int32]int64{0: 15, 1: 15})
	})
	ra.shutdown(t)
	rb.shutdown(t)
	wantAppliedInOrder(t, pool, "r0", 15)
	wantAppliedInOrder(t, pool, "r1", 15)
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

// Shutdown while partition 0's record waits out an hour's retry backoff
// (its handler refused it): Run returns promptly, partition 1's work is
// committed, partition 0's offset stays at the record; a restarted consumer
// applies the rest exactly once.
func TestShutdownWhileStuck(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceTo(t, addrs, 0, "s0", 0, 6)
	produceTo(t, addrs, 1, "s1", 0, 6)
	var refuse atomic.Bool
	refuse.Store(true)
	var refused atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "s0-2" && refuse.Load() {
			refused.Add(1)
			return errors.New("not yet")
		}
		return applyOrder(ctx, tx, ev)
	}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "shut", MaxPollRecords: 4, CommitInterval: 100 * time.Millisecond,
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		Retry:    idem.RetryPolicy{MaxAttempts: 5, Initial: time.Hour, Max: time.Hour}}
	r := startConsumer(t, pool, cfg, nil)
	waitBounded(t, 15*time.Second, "partition 0 in backoff and partition 1 done", func() bool {
		return refused.Load() == 1 && len(appliedIDs(t, pool, "s1")) == 6
	})
	produceTo(t, addrs, 1, "s1", 6, 4)
	waitBounded(t, 15*time.Second, "partition 1's later records", func() bool { return len(appliedIDs(t, pool, "s1")) == 10 })
	start := time.Now()
	r.shutdown(t)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("shutdown took %v with a partition in backoff", d)
	}
	if got := committedOffsets(t, addrs, "shut", "orders", 2); got[0] != 2 || got[1] != 10 {
		t.Fatalf("committed offsets %v after shutdown, want partition 0 at 2 (its record in backoff), 1 at 10", got)
	}
	refuse.Store(false)
	r2 := startConsumer(t, pool, cfg, nil)
	waitBounded(t, 15*time.Second, "the rest after a restart", func() bool {
		return committedIs(t, addrs, "shut", 2, map[int32]int64{0: 6, 1: 10})
	})
	r2.shutdown(t)
	wantAppliedInOrder(t, pool, "s0", 6)
	wantAppliedInOrder(t, pool, "s1", 10)
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events WHERE event_id LIKE 's%'`); n != 16 {
		t.Fatalf("%d processed-event rows, want 16", n)
	}
}

// The stuck record waits on a row lock the test holds (one hot row): each
// try fails with 55P03 (lock_timeout 100ms), which the processor waits out
// as an outage, using no attempt. Only partition 0 waits: partition 1's
// records are applied and committed meanwhile, and partition 0's committed
// offset stays at the waiting record. The lock released, every record is
// applied once, in order, none dead-lettered. Fails on main like
// TestStuckPartitionDoesNotStallOthers.
func TestHotRowLockStallsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["lock_timeout"] = "100ms" })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL);
		CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL); INSERT INTO hot VALUES (1, 0)`)
	produceTo(t, addrs, 0, "h0", 0, 6)
	produceTo(t, addrs, 1, "h1", 0, 6)
	lock, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(context.Background())
	if _, err := lock.Exec(context.Background(), `SELECT n FROM hot WHERE id = 1 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	var lockWaits atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "h0-2" {
			if _, err := tx.Exec(ctx, `UPDATE hot SET n = n + 1 WHERE id = 1`); err != nil {
				lockWaits.Add(1)
				return err
			}
		}
		return applyOrder(ctx, tx, ev)
	}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "hot", MaxPollRecords: 4,
		CommitInterval: 100 * time.Millisecond,
		Outage:         idem.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond},
		Handlers:       []idem.EventHandler{orderConsumer("orders", handler)}}, nil)
	waitBounded(t, 15*time.Second, "partition 1 applied and committed while h0-2 waits for the lock", func() bool {
		return lockWaits.Load() >= 2 && len(appliedIDs(t, pool, "h1")) == 6 &&
			committedIs(t, addrs, "hot", 2, map[int32]int64{0: 2, 1: 6})
	})
	if err := lock.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitBounded(t, 15*time.Second, "every record after the lock is released", func() bool {
		return committedIs(t, addrs, "hot", 2, map[int32]int64{0: 6, 1: 6})
	})
	r.shutdown(t)
	wantAppliedInOrder(t, pool, "h0", 6)
	wantAppliedInOrder(t, pool, "h1", 6)
	if n := count(t, pool, `SELECT n FROM hot WHERE id = 1`); n != 1 {
		t.Fatalf("hot row incremented %d times, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}
