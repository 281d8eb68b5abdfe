package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// Events for a topic that does not exist must not hold back the events of
// other topics forever, even when they fill whole batches: the broker
// answers (the topic is unknown), so this is no outage. The missing topic's
// rows carry a last_error naming the topic, and end PARKED after their
// attempt budget; every other event is published.
func TestMissingTopicDoesNotBlockOtherTopics(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	var missing []keyed
	for i := range 6 {
		missing = append(missing, keyed{Key: "m", Seq: i})
	}
	enqueue(t, pool, "no-such-topic", missing...)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1}, keyed{Key: "b", Seq: 0})
	logs := newLogSink()
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{
		BatchSize: 5, MaxAttempts: 2, PollInterval: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		PublishTimeout: 40 * time.Second, Logger: slog.New(logs),
	}))
	start := time.Now()
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			t.Logf("relay log:\n%s", strings.Join(*logs.lines, "\n"))
			logs.mu.Unlock()
		}
	})
	distinctInKeyOrder(t, addrs, "events", 3, 0)
	t.Logf("other topic's events published after %v", time.Since(start).Round(time.Millisecond))
	waitUntil(t, "the missing topic's rows to be parked", func() bool { return statusCounts(t, pool)["PARKED"] == 6 })
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE topic = 'no-such-topic' AND last_error LIKE '%UNKNOWN_TOPIC_OR_PARTITION%'`); n != 6 {
		t.Fatalf("%d parked rows say why (UNKNOWN_TOPIC_OR_PARTITION), want 6", n)
	}
	if !logs.has("no-such-topic") {
		t.Fatal("no log line names the missing topic")
	}
}

// recorder is an independent consumer: its own franz-go client reads the
// topic from the start for the whole test and keeps every record, so the
// test checks what actually reached the broker, not what the relay says.
type recorder struct {
	mu   sync.Mutex
	recs []*kgo.Record
	ids  map[string]bool
}

func startRecorder(t *testing.T, addrs []string, topic string) *recorder {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	rec := &recorder{ids: map[string]bool{}}
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			f := cl.PollFetches(ctx)
			rec.mu.Lock()
			for _, r := range f.Records() {
				rec.recs = append(rec.recs, r)
				rec.ids[header(r, idem.EventIDHeader)] = true
			}
			rec.mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cl.Close() })
	return rec
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func (r *recorder) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ids)
}

// check verifies, over every record received: each carries an event id,
// its Kafka key is its event's key, and per key the first delivery of each
// event is in enqueue order, starting at 0, with none missing. It returns
// the number of duplicate records.
func (r *recorder) check(t *testing.T, want int) (dups int) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]bool{}
	next := map[string]int{}
	for _, rec := range r.recs {
		id := header(rec, idem.EventIDHeader)
		if id == "" {
			t.Fatalf("record without %s header at offset %d", idem.EventIDHeader, rec.Offset)
		}
		if seen[id] {
			dups++
			continue
		}
		seen[id] = true
		var ev keyed
		if err := json.Unmarshal(rec.Value, &ev); err != nil {
			t.Fatal(err)
		}
		if string(rec.Key) != ev.Key {
			t.Fatalf("event %s has Kafka key %q, enqueued with %q", id, rec.Key, ev.Key)
		}
		if ev.Seq != next[ev.Key] {
			t.Fatalf("key %s: first delivery of seq %d came when %d was due: per-key order broken or an event lost", ev.Key, ev.Seq, next[ev.Key])
		}
		next[ev.Key]++
	}
	if len(seen) != want {
		t.Fatalf("%d distinct events on the topic, want %d", len(seen), want)
	}
	return dups
}

// feedKeys enqueues one event every 5ms, round-robin over keys keys, each
// key numbered from 0, until the returned stop is called; stop returns how
// many were enqueued.
func feedKeys(t *testing.T, pool *pgxpool.Pool, keys int) (stop func() int) {
	stopc := make(chan struct{})
	fed := make(chan int, 1)
	go func() {
		seq := map[string]int{}
		n := 0
		for {
			select {
			case <-stopc:
				fed <- n
				return
			case <-time.After(5 * time.Millisecond):
			}
			k := fmt.Sprintf("k%02d", n%keys)
			ctx := context.Background()
			tx, err := pool.Begin(ctx)
			if err == nil {
				err = idem.Enqueue(ctx, tx, "events", k, keyed{Key: k, Seq: seq[k]})
				if err == nil {
					err = tx.Commit(ctx)
				}
				_ = tx.Rollback(ctx)
			}
			if err != nil {
				t.Errorf("enqueue: %v", err)
				fed <- n
				return
			}
			seq[k]++
			n++
		}
	}()
	var once sync.Once
	var total int
	return func() int { once.Do(func() { close(stopc); total = <-fed }); return total }
}

// Repeated takeovers between two real relay processes, each frozen in turn
// (SIGSTOP) while the other stands by and then thawed (SIGCONT) after the
// other took over, five times, while events keep being enqueued over 20
// keys. An independent consumer reads the topic throughout: nothing is
// lost, and per key the first delivery of every event is in order, across
// every takeover and every thawed ex-leader.
//
//	go test ./runtime/kafka -run TestRepeatedFreezeTakeoversKeepKeyOrder -v -count=1
func TestRepeatedFreezeTakeoversKeepKeyOrder(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	addrs := cluster(t, 4, "events")
	rec := startRecorder(t, addrs, "events")
	dbURL := pgtest.Schema(t)
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	stopFeed := feedKeys(t, pool, 20)
	published := func() int64 { return statusCounts(t, pool)["PUBLISHED"] }

	procs := []*relayProc{startRelayProc(t, "A", dbURL, addrs, lease)}
	procs[0].waitFor(t, 0, 30*time.Second, "LEADING")
	procs = append(procs, startRelayProc(t, "B", dbURL, addrs, lease))
	procs[1].waitFor(t, 0, 30*time.Second, "standing by")
	var took []time.Duration
	for cycle := range 5 {
		leader, standby := procs[cycle%2], procs[(cycle+1)%2]
		before := published()
		waitUntil(t, "the leader to publish", func() bool { return published() >= before+20 })
		from := strings.Count(standby.text(), "\n") + 1
		at := leader.signal(t, syscall.SIGSTOP)
		led, _ := standby.waitFor(t, from, 30*time.Second, "LEADING")
		took = append(took, led.Sub(at))
		before = published()
		waitUntil(t, "the new leader to publish", func() bool { return published() >= before+20 })
		from = strings.Count(leader.text(), "\n") + 1
		leader.signal(t, syscall.SIGCONT)
		leader.waitFor(t, from, 30*time.Second, "relay stepped down")
	}
	total := stopFeed()
	waitUntil(t, "every event to be published", func() bool { return published() == int64(total) })
	waitUntil(t, "the consumer to see every event", func() bool { return rec.distinct() == total })
	if c := statusCounts(t, pool); len(c) != 1 {
		t.Fatalf("statuses %v, want only PUBLISHED", c)
	}
	dups := rec.check(t, total)
	t.Logf("lease %v: 5 freeze takeovers in %v; %d events over 20 keys, %d duplicate records", lease, took, total, dups)
}
