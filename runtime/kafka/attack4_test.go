package kafka_test

import (
	"bytes"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
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
	// Each failure on the first call of its own record: the partitions'
	// workers run concurrently, so a count over all calls could put all
	// three on one record, which used its budget of 3 and was
	// dead-lettered.
	var calls perEvent
	handler := calls.applyThen(func(ev order, n int) error {
		switch {
		case ev.EventID == "lw-1" && n == 1:
			runtime.Goexit()
		case ev.EventID == "lw-4" && n == 1:
			defer func() { recover() }()
			defer func() { panic("during goexit") }()
			runtime.Goexit()
		case ev.EventID == "lw-7" && n == 1:
			panic("plain")
		}
		return nil
	})
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
