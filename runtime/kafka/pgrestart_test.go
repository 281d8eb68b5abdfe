package kafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
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

// A real PostgreSQL server (the test's private cluster) restarted three
// ways — fast restart (57P01 on every session), crash (stop -m immediate,
// crash recovery, 57P03 while starting) and down for 3s (refused) — while
// records keep arriving: a consumer applies each record to a table and, in
// the same transaction, enqueues an outbox event that the relay publishes.
//
// The consumer's retry budget is one attempt, so anything the outage makes
// it charge to a record dead-letters it. Afterwards: every record applied
// exactly once, none dead-lettered, the group's offsets at the end; every
// outbox event published (at least once, per-key order kept), none charged
// an attempt or parked; consumer and relay both kept going by themselves
// after each restart and stop within a bound.
func TestConsumerAndRelayThroughRealPostgresRestarts(t *testing.T) {
	t.Parallel()
	const partitions = 4
	const maxBacklog = 400
	addrs := cluster(t, partitions, "orders", "events")
	pg := pgtest.PrivateCluster(t)
	ctx := context.Background()
	newPool := func() *pgxpool.Pool {
		return pgtest.PoolURL(t, pg.URL, func(c *pgxpool.Config) { c.MaxConns = 6 })
	}
	check, consumerPool, relayPool := newPool(), newPool(), newPool()
	if err := idem.Migrate(ctx, check); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, check, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)

	var logs capture
	// Each record's event: keyed by its partition, Seq its place in the
	// partition (Amount), so the relay's per-key order is checkable.
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if err := applyOrder(ctx, tx, ev); err != nil {
			return err
		}
		var n int
		if _, err := fmt.Sscanf(ev.EventID, "o-%d", &n); err != nil {
			return err
		}
		return idem.Enqueue(ctx, tx, "events", fmt.Sprintf("p%d", n%partitions), keyed{Key: fmt.Sprintf("p%d", n%partitions), Seq: int(ev.Amount)})
	}
	var out outcomes
	cfg := kafka.ConsumerConfig{
		Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", handler)}, MaxPollRecords: 20,
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: 20 * time.Millisecond, Max: 300 * time.Millisecond},
		StorageTimeout: 2 * time.Second,
		Logger:         slog.New(&logs),
	}
	consumer := startConsumer(t, consumerPool, cfg, &out)

	var relayLogs capture
	relay, err := idem.NewRelay(idem.NewStore(relayPool), publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond,
		Lease: 2 * time.Second, DBTimeout: time.Second, PublishTimeout: 2 * time.Second, MaxBackoff: 300 * time.Millisecond,
		Logger: slog.New(&relayLogs)})
	if err != nil {
		t.Fatal(err)
	}
	stopRelay := startRelay(t, relay)

	// The producer: batches of records, one per partition in turn, until
	// stopped; Amount is the record's place in its partition.
	prod, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(prod.Close)
	var produced atomic.Int64
	stopProducing := make(chan struct{})
	producerDone := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stopProducing:
				producerDone <- nil
				return
			case <-time.After(20 * time.Millisecond):
			}
			// At most maxBacklog records not yet handled: a consumer slowed
			// down by a loaded machine (the race detector, two cores) is
			// not buried under a backlog it cannot drain within the
			// checks' bounds, while records keep flowing through every
			// disruption.
			if produced.Load()-int64(out.get(idem.Applied)+out.get(idem.Duplicate)) > maxBacklog {
				continue
			}
			var recs []*kgo.Record
			base := produced.Load()
			for i := base; i < base+8; i++ {
				r := orderRecord("orders", order{EventID: fmt.Sprintf("o-%d", i), Amount: i / partitions})
				r.Partition = int32(i % partitions)
				recs = append(recs, r)
			}
			if err := prod.ProduceSync(ctx, recs...).FirstErr(); err != nil {
				producerDone <- err
				return
			}
			produced.Add(int64(len(recs)))
		}
	}()

	// progress waits, with a generous bound, until n more records were
	// applied: the consumer recovered by itself.
	progress := func(what string, n int) {
		t.Helper()
		target := out.get(idem.Applied) + n
		deadline := time.Now().Add(45 * time.Second)
		for out.get(idem.Applied) < target {
			if time.Now().After(deadline) {
				t.Fatalf("after %s: %d of %d records applied in 45s (outcomes %v); consumer log:\n%s",
					what, out.get(idem.Applied), target, out.snapshot(), logs.tail(20))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	progress("warm-up", 60)
	timings := pg.Disruptions(func(name string) { progress(name, 60) })
	close(stopProducing)
	if err := <-producerDone; err != nil {
		t.Fatalf("produce: %v", err)
	}
	n := produced.Load()

	// The backlog drains (one more record applied or dead-lettered within
	// every 45s: a loaded machine may make the drain slow, a stopped
	// consumer fails it).
	var e, d int64
	untilStalled(t, func() (int64, bool) {
		e = count(t, check, `SELECT count(DISTINCT event_id) FROM effects`)
		d = count(t, check, `SELECT count(*) FROM idem_dead_letters`)
		return e + d, e+d >= n
	}, func() string {
		return fmt.Sprintf("%d of %d records applied, %d dead-lettered, none more for 45s after the last restart; consumer log:\n%s", e, n, d, logs.tail(20))
	})
	consumer.shutdown(t) // bounded: fails the test after 30s
	if d := count(t, check, `SELECT count(*) FROM idem_dead_letters`); d != 0 {
		var reasons []string
		rows, _ := check.Query(ctx, `SELECT format('%s/%s', kpartition, koffset), last_error FROM idem_dead_letters LIMIT 5`)
		for rows != nil && rows.Next() {
			var id, reason string
			_ = rows.Scan(&id, &reason)
			reasons = append(reasons, id+": "+reason)
		}
		t.Errorf("%d good records dead-lettered because of the restarts: %q", d, reasons)
	}
	if dup := count(t, check, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) d`); dup != 0 {
		t.Errorf("%d records applied more than once", dup)
	}
	if e := count(t, check, `SELECT count(*) FROM effects`); e != n {
		t.Errorf("%d effects, %d records produced", e, n)
	}
	// A record whose COMMIT went through but whose answer was lost in the
	// restart is seen again as a duplicate (its effect is not repeated, as
	// checked above): applied plus duplicates cover every record.
	if a, d := int64(out.get(idem.Applied)), int64(out.get(idem.Duplicate)); out.get(idem.DeadLettered) != 0 || a > n || a+d < n {
		t.Errorf("outcomes %v for %d records: want none dead-lettered, each applied or (after a lost commit answer) a duplicate", out.snapshot(), n)
	}
	offs := committedOffsets(t, addrs, "g", "orders", partitions)
	ends := endOffsets(t, addrs, "orders", partitions)
	for p := int32(0); p < partitions; p++ {
		if offs[p] != ends[p] {
			t.Errorf("partition %d: committed offset %d, end %d", p, offs[p], ends[p])
		}
	}

	// The relay: every event published, none charged or parked.
	untilStalled(t, func() (int64, bool) {
		published := statusCounts(t, check)["PUBLISHED"]
		return published, published == n
	}, func() string {
		return fmt.Sprintf("outbox %v, none more published for 45s after the last restart, want %d published; relay log:\n%s", statusCounts(t, check), n, relayLogs.tail(20))
	})
	if c := statusCounts(t, check); len(c) != 1 {
		t.Errorf("outbox statuses %v, want only PUBLISHED", c)
	}
	if a := count(t, check, `SELECT coalesce(max(attempts), 0) FROM idem_outbox`); a != 0 {
		t.Errorf("an outbox event was charged %d attempts by the restarts", a)
	}
	stopRelay()
	dups := distinctInKeyOrder(t, addrs, "events", int(n), 0)
	t.Logf("%d records; outcomes %v; %d duplicate events published; %s", n, out.snapshot(), dups, strings.Join(timings, "; "))
	t.Logf("consumer logged %d lines, relay %d", logs.len(), relayLogs.len())
	if os.Getenv("PGRESTART_LOGS") != "" {
		t.Logf("consumer:\n%s\nrelay:\n%s", logs.tail(1000), relayLogs.tail(1000))
	}
}

func (o *outcomes) snapshot() map[idem.Outcome]int {
	o.mu.Lock()
	defer o.mu.Unlock()
	m := map[idem.Outcome]int{}
	for k, v := range o.n {
		m[k] = v
	}
	return m
}

// tail is the last n lines captured.
func (c *capture) tail(n int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	l := c.lines
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func (c *capture) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.lines)
}

// A record whose COMMIT went through on the server but whose answer never
// reached the consumer, because the server was restarted fast or crashed
// while the commit waited for a synchronous standby (see
// pgtest.SyncStandbyNamed): with a retry budget of one attempt, the record
// is neither dead-lettered nor applied twice; redelivered after the
// restart, it is a duplicate, and the offset moves past it.
func TestConsumerCommitUnansweredAcrossRestart(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"fast", "immediate"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			addrs := cluster(t, 1, "orders")
			pg := pgtest.PrivateCluster(t)
			ctx := context.Background()
			pool := pgtest.PoolURL(t, pg.URL, nil)
			if err := idem.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
			var out outcomes
			var logs capture
			cfg := kafka.ConsumerConfig{
				Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder)},
				Retry:          idem.RetryPolicy{MaxAttempts: 1},
				Outage:         idem.Backoff{Initial: 20 * time.Millisecond, Max: 300 * time.Millisecond},
				StorageTimeout: 20 * time.Second, // longer than the wait below: the restart ends the commit, not a timeout
				Logger:         slog.New(&logs),
			}
			pgtest.SyncStandbyNamed(t, pg.URL, "phantom")
			r := startConsumer(t, pool, cfg, &out)
			produce(t, producer(t, addrs), orderRecord("orders", order{EventID: "e-1", Amount: 1}))
			pgtest.WaitSyncRep(t, pg.URL, nil)
			if mode == "fast" {
				pg.Restart("fast")
			} else {
				pg.Stop("immediate")
				pg.Start()
			}
			pgtest.SyncStandbyNamed(t, pg.URL, "")
			produce(t, producer(t, addrs), orderRecord("orders", order{EventID: "e-2", Amount: 2}))
			waitBounded(t, 30*time.Second, "both records done after the restart", func() bool {
				return out.get(idem.Applied)+out.get(idem.Duplicate)+out.get(idem.DeadLettered) >= 2
			})
			r.shutdown(t)
			check := pgtest.PoolURL(t, pg.URL, nil)
			if d := count(t, check, `SELECT count(*) FROM idem_dead_letters`); d != 0 || out.get(idem.DeadLettered) != 0 {
				t.Errorf("%d dead letters (outcomes %v): a commit whose answer the restart lost was charged to the record", d, out.snapshot())
			}
			if e := count(t, check, `SELECT count(*) FROM effects WHERE event_id = 'e-1'`); e != 1 {
				t.Errorf("e-1 applied %d times", e)
			}
			if out.get(idem.Duplicate) != 1 || out.get(idem.Applied) != 1 {
				t.Errorf("outcomes %v, want e-1 a duplicate (its commit went through) and e-2 applied", out.snapshot())
			}
			if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 2 {
				t.Errorf("committed offset %d, want 2", got)
			}
			t.Logf("consumer log:\n%s", logs.tail(10))
		})
	}
}

// untilStalled polls progress every 20ms until it reports done, and fails
// the test with failure's message when its count has not grown for 45s: a
// drain that is slow on a loaded machine passes, one that stopped fails.
func untilStalled(t *testing.T, progress func() (count int64, done bool), failure func() string) {
	t.Helper()
	stalled := time.Now().Add(45 * time.Second)
	for last := int64(-1); ; time.Sleep(20 * time.Millisecond) {
		n, done := progress()
		if done {
			return
		}
		if n > last {
			last, stalled = n, time.Now().Add(45*time.Second)
		}
		if time.Now().After(stalled) {
			t.Fatal(failure())
		}
	}
}
