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
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// faultDB is db with a fault-injecting proxy in front of PostgreSQL: the
// consumer uses the proxied pool, the test checks through the direct one.
func faultDB(t *testing.T) (direct, proxied *pgxpool.Pool, px *faultproxy.Proxy) {
	t.Helper()
	url := pgtest.Schema(t)
	px = faultproxy.New(t, faultproxy.PostgresTarget(url))
	direct = pgtest.PoolURL(t, url, nil)
	if err := idem.Migrate(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, direct, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return direct, pgtest.PoolURL(t, px.RewriteURL(url), nil), px
}

// faultConfig: a retry budget of one attempt, so any storage error charged
// to a record dead-letters it at once; short storage timeouts and outage
// waits, so the test notices a blackhole quickly.
func faultConfig(addrs []string, h idem.EventHandler) kafka.ConsumerConfig {
	return kafka.ConsumerConfig{
		Brokers: addrs, Handlers: []idem.EventHandler{h}, MaxPollRecords: 10,
		Retry:          idem.RetryPolicy{MaxAttempts: 1},
		Outage:         idem.Backoff{Initial: 10 * time.Millisecond, Max: 200 * time.Millisecond},
		StorageTimeout: 500 * time.Millisecond,
	}
}

func produceOrders(t *testing.T, addrs []string, partitions int32, n int, prefix string) {
	t.Helper()
	var recs []*kgo.Record
	for i := 0; i < n; i++ {
		r := orderRecord("orders", order{EventID: fmt.Sprintf("%s-%d", prefix, i), Amount: int64(i)})
		r.Partition = int32(i) % partitions
		recs = append(recs, r)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	produce(t, cl, recs...)
}

// Issue 8 item 2: PostgreSQL goes away while a record's transaction is open
// — refused (down), reset (cut), or silent with connections open
// (blackhole) — for longer than the whole retry budget. No valid record is
// dead-lettered, the record in flight is applied once after the database
// returns, and so is every record after it. Before the fix, the failed
// statements counted against the handler's budget and the record in flight
// was dead-lettered ("handler failed") without being wrong.
func TestDBFaultsDuringConsume(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"down", "cut", "blackhole"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			const n = 30
			addrs := cluster(t, 1, "orders")
			direct, proxied, px := faultDB(t)
			produceOrders(t, addrs, 1, n, mode)
			entered, release := make(chan struct{}), make(chan struct{})
			var held atomic.Bool
			handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
				if ev.EventID == mode+"-10" && held.CompareAndSwap(false, true) {
					close(entered) // inside the transaction, after the dedupe insert
					<-release
				}
				return applyOrder(ctx, tx, ev)
			}
			var out outcomes
			cfg := faultConfig(addrs, orderConsumer("orders", handler))
			cfg.OnRecord = out.record
			r := startConsumerOn(t, proxied, cfg)
			<-entered
			switch mode {
			case "down":
				px.Down()
			case "cut":
				px.Cut()
			case "blackhole":
				px.Blackhole()
			}
			close(release)
			// Longer than the budget (one attempt) and than StorageTimeout:
			// every BEGIN meanwhile fails or times out.
			time.Sleep(2 * time.Second)
			if mode != "cut" && count(t, direct, `SELECT count(*) FROM effects`) != 10 {
				t.Fatalf("%d effects during the outage, want the 10 before it", count(t, direct, `SELECT count(*) FROM effects`))
			}
			px.Restore()
			waitBounded(t, 30*time.Second, "every record done after the outage", func() bool {
				return count(t, direct, `SELECT count(*) FROM effects`)+count(t, direct, `SELECT count(*) FROM idem_dead_letters`) >= n
			})
			r.shutdown(t)
			if d := count(t, direct, `SELECT count(*) FROM idem_dead_letters`); d != 0 {
				t.Fatalf("%d valid records dead-lettered by a database outage", d)
			}
			if e := count(t, direct, `SELECT count(*) FROM effects`); e != n {
				t.Fatalf("%d effects, want %d", e, n)
			}
			if out.get(idem.Applied) != n {
				t.Fatalf("outcomes %v, want %d applied", out.n, n)
			}
			if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != n {
				t.Fatalf("committed offset %d, want %d", got, n)
			}
		})
	}
}

// Issue 8 item 2: a shutdown while the database is unreachable ends the wait
// at once (not after StorageTimeout, not when the database returns), commits
// no offset for the record being waited on, and a restart after recovery
// applies it once.
func TestShutdownDuringDBOutage(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"down", "blackhole"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			addrs := cluster(t, 1, "orders")
			direct, proxied, px := faultDB(t)
			produceOrders(t, addrs, 1, 5, mode)
			var out outcomes
			cfg := faultConfig(addrs, orderConsumer("orders", applyOrder))
			cfg.StorageTimeout = time.Minute // only the shutdown may end the wait
			cfg.OnRecord = out.record
			cfg.MaxPollRecords = 1
			r := startConsumerOn(t, proxied, cfg)
			waitBounded(t, 20*time.Second, "two records applied", func() bool { return out.total() >= 2 })
			if mode == "down" {
				px.Down()
			} else {
				px.Blackhole()
			}
			time.Sleep(500 * time.Millisecond) // the consumer is now waiting on the next record
			done := make(chan struct{})
			go func() { r.shutdown(t); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("shutdown did not end the wait for the database within 10s (StorageTimeout is 1m)")
			}
			applied := int64(out.get(idem.Applied))
			if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != applied {
				t.Fatalf("committed offset %d after shutdown, want %d: the records done and nothing else", got, applied)
			}
			px.Restore()
			var again outcomes
			cfg.OnRecord = again.record
			cfg.StorageTimeout = 0
			r = startConsumerOn(t, proxied, cfg)
			// Every record whose offset was not committed is delivered again
			// and done once: applied, or a duplicate if the outage cut the
			// connection after the server committed but before the answer
			// arrived (the outcome of that COMMIT was unknown, so its offset
			// was not marked).
			waitBounded(t, 20*time.Second, "the rest done after restart", func() bool { return int64(again.total()) == 5-applied })
			r.shutdown(t)
			if e, d := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(*) FROM idem_dead_letters`); e != 5 || d != 0 ||
				count(t, direct, `SELECT count(DISTINCT event_id) FROM effects`) != 5 {
				t.Fatalf("after restart: outcomes %v, %d effects (want 5, once each), %d dead letters", again.n, e, d)
			}
			if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 5 {
				t.Fatalf("committed offset %d at the end, want 5", got)
			}
		})
	}
}

// Issue 8 item 2: a rebalance while a member waits out a database outage. The
// waiting member must let the rebalance through (the poll loop holds a
// rebalance only while it hands out a poll's records; a revoked partition's
// worker is cancelled, which ends its wait) so the joining member gets a
// partition while the database is still down; before, the poll held the
// rebalance until the database came back (or the rebalance timeout kicked
// the member out). After recovery every event is applied once, nothing is
// dead-lettered, and every partition's committed offset is its end.
func TestRevokeDuringDBOutage(t *testing.T) {
	t.Parallel()
	const partitions, n = 2, 40
	addrs := cluster(t, partitions, "orders")
	direct, proxied, px := faultDB(t)
	produceOrders(t, addrs, partitions, n, "rv")
	var a, b outcomes
	// After its first 4 calls the handler waits at the gate, inside its
	// transaction, until the database is down: A is surely mid-record
	// with records left when the outage starts. (Without the gate the
	// partition workers applied all 40 records between two looks at
	// "A applied 4", and the database went down with nothing left.)
	gate := make(chan struct{})
	var calls, gated atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if calls.Add(1) > 4 {
			gated.Add(1)
			select {
			case <-gate:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return applyOrder(ctx, tx, ev)
	}
	cfg := faultConfig(addrs, orderConsumer("orders", handler))
	cfg.MaxPollRecords = 4
	cfg.OnRecord = a.record
	logsA := &capture{}
	cfg.Logger = slog.New(logsA)
	ra := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 20*time.Second, "member A to apply 4 records and wait at the gate", func() bool { return a.total() >= 4 && gated.Load() > 0 })
	px.Down()
	close(gate)
	waitBounded(t, 20*time.Second, "member A waiting out the outage", func() bool {
		return logsA.has("storage unavailable; waiting")
	})

	logs := &capture{}
	cfg.OnRecord = b.record
	cfg.Logger = slog.New(logs)
	rb := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 20*time.Second, "member B to get a partition while the database is down", func() bool {
		return logs.has("partitions assigned", "orders")
	})
	if count(t, direct, `SELECT count(*) FROM effects`) >= n {
		t.Fatal("the database was not down")
	}
	px.Restore()
	waitBounded(t, 30*time.Second, "every event after recovery", func() bool { return count(t, direct, `SELECT count(*) FROM effects`) >= n })
	ra.shutdown(t)
	rb.shutdown(t)
	if e, d := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(*) FROM idem_dead_letters`); e != n || d != 0 {
		t.Fatalf("%d effects (want %d), %d dead letters (want 0)", e, n, d)
	}
	if got, want := committedOffsets(t, addrs, "g", "orders", partitions), endOffsets(t, addrs, "orders", partitions); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("committed offsets %v, want %v", got, want)
	}
	if b.total() == 0 {
		t.Fatal("member B applied nothing")
	}
}

// startConsumerOn is startConsumer on a given pool (the proxied one).
func startConsumerOn(t *testing.T, pool *pgxpool.Pool, cfg kafka.ConsumerConfig) *running {
	t.Helper()
	return startConsumer(t, pool, cfg, nil)
}

// capture is a slog.Handler that keeps every line, for tests that wait for
// something the consumer only logs.
type capture struct {
	mu    sync.Mutex
	lines []string
}

func (c *capture) Enabled(context.Context, slog.Level) bool { return true }
func (c *capture) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *capture) WithGroup(string) slog.Handler            { return c }
func (c *capture) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, b.String())
	return nil
}

// has reports whether a line starts with msg and contains every one of want.
func (c *capture) has(msg string, want ...string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
next:
	for _, l := range c.lines {
		if !strings.HasPrefix(l, msg) {
			continue
		}
		for _, w := range want {
			if !strings.Contains(l, w) {
				continue next
			}
		}
		return true
	}
	return false
}
