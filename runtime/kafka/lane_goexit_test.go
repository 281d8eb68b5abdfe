package kafka_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// perEvent counts a handler's calls per event id.
type perEvent struct {
	mu sync.Mutex
	n  map[string]int
}

// applyThen is a handler that counts the call, applies the order and then
// returns what then returns for it, given the call's number for the
// order's event id (1 on its first call).
func (c *perEvent) applyThen(then func(ev order, n int) error) func(context.Context, pgx.Tx, order) error {
	return func(ctx context.Context, tx pgx.Tx, ev order) error {
		c.mu.Lock()
		if c.n == nil {
			c.n = map[string]int{}
		}
		c.n[ev.EventID]++
		n := c.n[ev.EventID]
		c.mu.Unlock()
		if err := applyOrder(ctx, tx, ev); err != nil {
			return err
		}
		return then(ev, n)
	}
}

// calls is how many times the handler ran for the event id.
func (c *perEvent) calls(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// goexitFirst is a handler that, on the first call for each event id in
// goexitIDs, writes its effect and then ends its goroutine with
// runtime.Goexit; every other call applies the order. goexited is closed
// after the first Goexit.
type goexitFirst struct {
	perEvent
	ids      map[string]bool
	once     sync.Once
	goexited chan struct{}
}

func newGoexitFirst(ids ...string) *goexitFirst {
	g := &goexitFirst{ids: map[string]bool{}, goexited: make(chan struct{})}
	for _, id := range ids {
		g.ids[id] = true
	}
	return g
}

func (g *goexitFirst) handle(ctx context.Context, tx pgx.Tx, ev order) error {
	return g.applyThen(func(ev order, n int) error {
		if n == 1 && g.ids[ev.EventID] {
			g.once.Do(func() { close(g.goexited) })
			runtime.Goexit()
		}
		return nil
	})(ctx, tx, ev)
}

// The consumer shut down while a record that Goexited waits out its retry
// backoff (an hour): Run returns at once, the record's effect is rolled
// back and its offset is not committed; the next consumer of the group
// applies it, and every record ends applied exactly once. No lane worker
// is left behind.
func TestLaneShutdownDuringResumedBackoff(t *testing.T) {
	addrs := cluster(t, 1, "orders")
	pool := db(t)
	produceOrders(t, addrs, 1, 6, "sdb")
	g := newGoexitFirst("sdb-2")
	retry := idem.RetryPolicy{MaxAttempts: 3, Initial: time.Hour, Max: time.Hour}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "sdb",
		Handlers: []idem.EventHandler{orderConsumer("orders", g.handle)}, Retry: retry}, nil)
	select {
	case <-g.goexited:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never ran on sdb-2")
	}
	time.Sleep(100 * time.Millisecond) // into the hour's backoff
	start := time.Now()
	r.shutdown(t)
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("shutdown took %v", d)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'sdb-2'`); n != 0 {
		t.Fatalf("%d effects of the record that Goexited, want 0", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events WHERE event_id = 'sdb-2'`); n != 0 {
		t.Fatalf("the record that Goexited has a processed-event row")
	}
	if off := committedOffsets(t, addrs, "sdb", "orders", 1)[0]; off > 2 {
		t.Fatalf("committed offset %d, past the record not done (offset 2)", off)
	}
	r2 := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "sdb",
		Handlers: []idem.EventHandler{orderConsumer("orders", g.handle)}, Retry: retry}, nil)
	waitBounded(t, 30*time.Second, "every record", func() bool { return count(t, pool, `SELECT count(*) FROM effects`) >= 6 })
	r2.shutdown(t)
	if n := count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != 6 {
		t.Fatalf("%d distinct effects, want 6", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 6 {
		t.Fatalf("%d effects, want 6 (each once)", n)
	}
	waitBounded(t, 10*time.Second, "no lane worker after shutdown", func() bool { return laneWorkerCount(t) == 0 })
}

// A rebalance (a second member joins) while records that Goexited wait out
// an hour's backoff, one on each partition: the rebalance is not held up,
// the partition that moves is rolled back at its stuck record and applied
// by the new member; the one that stays waits (a rebalance touches only
// what it moves) until its member shuts down, promptly, and the other
// member applies it. Every record ends applied exactly once, well within
// the hour.
func TestLaneRebalanceDuringResumedBackoff(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "orders")
	pool := db(t)
	produceOrders(t, addrs, 2, 10, "rdb")
	g := newGoexitFirst("rdb-4", "rdb-5")
	retry := idem.RetryPolicy{MaxAttempts: 3, Initial: time.Hour, Max: time.Hour}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "rdb",
		Handlers: []idem.EventHandler{orderConsumer("orders", g.handle)}, Retry: retry}
	ra := startConsumer(t, pool, cfg, nil)
	waitBounded(t, 30*time.Second, "both partitions stuck (rdb-4 and rdb-5 Goexited)", func() bool {
		return g.calls("rdb-4") == 1 && g.calls("rdb-5") == 1
	})
	time.Sleep(100 * time.Millisecond) // into the hour's backoff
	rb := startConsumer(t, pool, cfg, nil)
	// The moved partition's 3 records from its stuck one, and the 2 before
	// each stuck record.
	waitBounded(t, 30*time.Second, "the moved partition's records", func() bool { return count(t, pool, `SELECT count(*) FROM effects`) >= 7 })
	start := time.Now()
	ra.shutdown(t)
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("shutdown took %v", d)
	}
	waitBounded(t, 30*time.Second, "every record", func() bool { return count(t, pool, `SELECT count(*) FROM effects`) >= 10 })
	rb.shutdown(t)
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 10 {
		t.Fatalf("%d effects, want 10 (each once)", n)
	}
	if n := count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != 10 {
		t.Fatalf("%d distinct effects, want 10", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

// Batch mode: a batch whose handler fails, Goexits and panics falls back to
// record by record on the lane; the budget counts the batch's attempt, and
// every record ends applied once or dead-lettered with the budget used.
func TestLaneBatchFallbackBudget(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	pool := db(t)
	produceOrders(t, addrs, 1, 12, "bfb")
	var calls perEvent
	var poisonCalls atomic.Int64
	handler := calls.applyThen(func(ev order, n int) error {
		switch {
		case ev.EventID == "bfb-3" && n == 1:
			return errors.New("refused once")
		case ev.EventID == "bfb-3" && n == 2:
			runtime.Goexit()
		case ev.EventID == "bfb-7": // always: its budget of 3 ends in a dead letter
			poisonCalls.Add(1)
			runtime.Goexit()
		case ev.EventID == "bfb-9" && n == 1:
			panic("once")
		}
		return nil
	})
	out := &outcomes{}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "bfb", BatchSize: 4,
		Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		Retry:    idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond}}, out)
	waitBounded(t, 30*time.Second, "every record", func() bool { return out.total() >= 12 })
	r.shutdown(t)
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 11 {
		t.Fatalf("%d effects, want 11 (each but the poison once)", n)
	}
	if n := count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != 11 {
		t.Fatalf("%d distinct effects, want 11", n)
	}
	if a := count(t, pool, `SELECT attempts FROM idem_dead_letters WHERE koffset = 7`); a != 3 {
		t.Fatalf("the poison record's dead letter has %d attempts, want 3", a)
	}
	if p := poisonCalls.Load(); p != 3 {
		t.Fatalf("the poison record's handler ran %d times, want 3 (one in the batch, two alone)", p)
	}
	if n := calls.calls("bfb-3"); n != 3 {
		t.Fatalf("bfb-3's handler ran %d times, want 3", n)
	}
}

// commitExitTracer is a pgx tracer, the application's, that ends the
// goroutine it runs on (runtime.Goexit) in TraceBatchEnd of every odd
// batch holding a COMMIT (the 1st, 3rd, ...), up to limit of them: after
// the server answered, the transaction committed.
type commitExitTracer struct {
	commits atomic.Int64
	exits   atomic.Int64
	limit   int64
}

type commitBatchKey struct{}

func (e *commitExitTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (e *commitExitTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (e *commitExitTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if strings.EqualFold(strings.TrimSpace(q.SQL), "commit") {
			return context.WithValue(ctx, commitBatchKey{}, true)
		}
	}
	return ctx
}
func (e *commitExitTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (e *commitExitTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	if ctx.Value(commitBatchKey{}) == nil || d.Err != nil {
		return
	}
	if n := e.commits.Add(1); n%2 == 1 && e.exits.Load() < e.limit {
		e.exits.Add(1)
		runtime.Goexit()
	}
}

// End to end on kfake, batch mode (BatchSize 4) with two handlers on the
// topic: a handler error in the middle of a batch, a panic, and a tracer
// that ends the lane's worker after COMMITs took effect (the batch's and
// the records' own, in the fallback). Every record is applied once by each
// handler, none is dead-lettered, and the group's committed offset reaches
// the end. Fails on lanerec: a record whose COMMIT was followed by the
// Goexit was charged an attempt, and one on its last attempt was
// dead-lettered although applied.
func TestLaneBatchGoexitAfterCommitEndToEnd(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	tr := &commitExitTracer{limit: 6}
	pool := tracedDB(t, tr)
	produceOrders(t, addrs, 1, 12, "gac")
	var calls perEvent
	billing := calls.applyThen(func(ev order, n int) error {
		switch {
		case ev.EventID == "gac-5" && n == 1:
			return errors.New("refused once")
		case ev.EventID == "gac-9" && n == 1:
			panic("once")
		}
		return nil
	})
	shipping := idem.Consume(idem.EventSpec[order]{
		Topic: "orders", Context: "shipping",
		EventID: func(o order) string { return o.EventID },
	}, func(ctx context.Context, tx pgx.Tx, ev order) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, "ship:"+ev.EventID, ev.Amount)
		return err
	})
	out := &outcomes{}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Group: "gac", BatchSize: 4,
		Handlers: []idem.EventHandler{orderConsumer("orders", billing), shipping},
		Retry:    idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond}}, out)
	waitBounded(t, 30*time.Second, "every record", func() bool { return out.total() >= 24 })
	time.Sleep(200 * time.Millisecond)
	r.shutdown(t)
	if tr.exits.Load() == 0 {
		t.Fatal("the tracer never ended the worker")
	}
	t.Logf("%d Goexits after a COMMIT; outcomes applied %d, duplicate %d, dead-lettered %d", tr.exits.Load(),
		out.get(idem.Applied), out.get(idem.Duplicate), out.get(idem.DeadLettered))
	if n := count(t, pool, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Errorf("%d dead letters of applied records, want 0", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 24 {
		t.Errorf("%d effects, want 24 (12 records, 2 handlers, each once)", n)
	}
	if n := count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != 24 {
		t.Errorf("%d distinct effects, want 24", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_processed_events`); n != 24 {
		t.Errorf("%d processed-event rows, want 24", n)
	}
	if got := committedOffsets(t, addrs, "gac", "orders", 1)[0]; got != 12 {
		t.Errorf("committed offset %d, want 12", got)
	}
}

// Not lane code, and the same on main: OnRecord runs on the partition
// loop's goroutine, so a Goexit there (a test's t.FailNow in an OnRecord
// callback, say) ends that goroutine. The poll's records after it must be
// fetched again, not skipped. Fails on lanerec (and main): records 4 to 9
// were never applied, and the later records' marks committed offset 12.
func TestOnRecordGoexitLosesNoRecord(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	pool := db(t)
	produceOrders(t, addrs, 1, 10, "orx")
	var once atomic.Bool
	cfg := kafka.ConsumerConfig{Brokers: addrs, Group: "orx", BatchSize: 1,
		Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder)},
		OnRecord: func(_ *idem.EventHandler, rec *idem.Record, _ idem.Outcome) {
			if rec.Offset == 3 && once.CompareAndSwap(false, true) {
				runtime.Goexit()
			}
		}}
	startConsumer(t, pool, cfg, nil)
	produceOrders(t, addrs, 1, 2, "ory") // later records: their marks commit past the lost ones
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && count(t, pool, `SELECT count(*) FROM effects`) < 12 {
		time.Sleep(50 * time.Millisecond)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 12 {
		var missing []string
		rows, err := pool.Query(context.Background(), `SELECT id FROM unnest(ARRAY['orx-4','orx-5','orx-6','orx-7','orx-8','orx-9','ory-0','ory-1']) id WHERE id NOT IN (SELECT event_id FROM effects)`)
		if err == nil {
			for rows.Next() {
				var id string
				_ = rows.Scan(&id)
				missing = append(missing, id)
			}
			rows.Close()
		}
		t.Fatalf("%d effects after 10s, want 12; missing %v; committed offset %v", n, missing, committedOffsets(t, addrs, "orx", "orders", 1))
	}
}
