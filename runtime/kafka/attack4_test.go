package kafka_test

import (
	"bytes"
	"context"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
	"github.com/jackc/pgx/v5"
)

// laneWorkerCount counts goroutines running a guardlane worker.
func laneWorkerCount(t *testing.T) int {
	t.Helper()
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 2); err != nil {
		t.Fatal(err)
	}
	return strings.Count(buf.String(), "guardlane.(*Lane).work(")
}

// A consumer whose handlers Goexit (also with a panic recovered during the
// Goexit) and panic leaves no lane worker behind: none between polls, none
// after shutdown, and every record is applied once. Not parallel: it counts
// the process's lane workers.
func TestAttack4ConsumerLeavesNoLaneWorker(t *testing.T) {
	addrs := cluster(t, 3, "orders")
	pool := db(t)
	produceOrders(t, addrs, 3, 30, "lw")
	var calls atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		switch n := calls.Add(1); {
		case n == 2:
			runtime.Goexit()
		case n == 5:
			defer func() { recover() }()
			defer func() { panic("during goexit") }()
			runtime.Goexit()
		case n == 8:
			panic("plain")
		}
		return applyOrder(ctx, tx, ev)
	}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		MaxPollRecords: 4, Retry: idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond}}, nil)
	waitBounded(t, 30*time.Second, "every event", func() bool { return count(t, pool, `SELECT count(*) FROM effects`) >= 30 })
	waitBounded(t, 10*time.Second, "no lane worker between polls", func() bool { return laneWorkerCount(t) == 0 })
	r.shutdown(t)
	// A lane's stop lets its idle worker end on its own schedule, a moment
	// after the loop (and so the shutdown) returned: wait for it, bounded.
	waitBounded(t, 10*time.Second, "no lane worker after shutdown", func() bool { return laneWorkerCount(t) == 0 })
	if e := count(t, pool, `SELECT count(*) FROM effects`); e != 30 {
		t.Fatalf("%d effects, want 30", e)
	}
}
