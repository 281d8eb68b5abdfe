package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// keyed is the outbox test event: a sequence number per key.
type keyed struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
	Pad string `json:"pad,omitempty"`
}

func enqueue(t testing.TB, pool *pgxpool.Pool, topic string, evs ...keyed) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, ev := range evs {
		if err := idem.Enqueue(ctx, tx, topic, ev.Key, ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func publisher(t testing.TB, addrs []string) *kafka.Publisher {
	t.Helper()
	p, err := kafka.NewPublisher(addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// startRelay runs r until the test ends.
func startRelay(t testing.TB, r *idem.Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Error("relay did not stop in 30s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// readTopic consumes topic from the start until want records arrived.
func readTopic(t testing.TB, addrs []string, topic string, want int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < want {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d records from %s", len(out), want, topic)
		}
		out = append(out, f.Records()...)
	}
	return out
}

func statusCounts(t testing.TB, pool *pgxpool.Pool) map[string]int64 {
	t.Helper()
	c, err := idem.NewStore(pool).OutboxCounts(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// An event enqueued in a transaction that rolls back is never published.
func TestEnqueueRolledBackNeverPublished(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.Enqueue(ctx, tx, "events", "k", keyed{Key: "k", Seq: -1}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, "events", keyed{Key: "k", Seq: 1})
	startRelay(t, &idem.Relay{Pool: pool, Publisher: publisher(t, addrs), PollInterval: 50 * time.Millisecond})
	recs := readTopic(t, addrs, "events", 1)
	time.Sleep(300 * time.Millisecond)
	recs = append(recs, readTopic(t, addrs, "events", 1)[1:]...)
	if len(recs) != 1 || !strings.Contains(string(recs[0].Value), `"seq":1`) {
		t.Fatalf("published %d records (%s), want only the committed one", len(recs), recs[0].Value)
	}
	var id string
	for _, h := range recs[0].Headers {
		if h.Key == idem.EventIDHeader {
			id = string(h.Value)
		}
	}
	if id == "" || string(recs[0].Key) != "k" {
		t.Fatalf("record key %q, %s header %q", recs[0].Key, idem.EventIDHeader, id)
	}
	if c := statusCounts(t, pool); c["PUBLISHED"] != 1 || len(c) != 1 {
		t.Fatalf("outbox statuses %v, want 1 PUBLISHED and no other row", c)
	}
}

// Three relays started together on 10,000 events over 100 keys: one leads,
// every event is published, and each key's events appear in order.
func TestThreeRelaysPublishAllInKeyOrder(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 8, "events")
	pool := db(t)
	const events, keys = 10000, 100
	batch := make([]keyed, 0, 1000)
	for i := 0; i < events; i++ {
		batch = append(batch, keyed{Key: fmt.Sprintf("key-%d", i%keys), Seq: i / keys})
		if len(batch) == cap(batch) {
			enqueue(t, pool, "events", batch...)
			batch = batch[:0]
		}
	}
	var leaders sync.WaitGroup
	leaders.Add(1)
	var once sync.Once
	for i := 0; i < 3; i++ {
		startRelay(t, &idem.Relay{Pool: pool, Publisher: publisher(t, addrs), BatchSize: 500,
			PollInterval: 50 * time.Millisecond, OnLeader: func() { once.Do(leaders.Done) }})
	}
	recs := readTopic(t, addrs, "events", events)
	waitUntil(t, "all rows PUBLISHED", func() bool { return statusCounts(t, pool)["PUBLISHED"] == events })

	next := map[string]int{}
	ids := map[string]bool{}
	for _, r := range recs {
		var ev keyed
		if err := json.Unmarshal(r.Value, &ev); err != nil {
			t.Fatal(err)
		}
		if string(r.Key) != ev.Key {
			t.Fatalf("record key %q for event of key %q", r.Key, ev.Key)
		}
		if ev.Seq != next[ev.Key] {
			t.Fatalf("key %s: got seq %d, want %d: per-key order broken", ev.Key, ev.Seq, next[ev.Key])
		}
		next[ev.Key]++
		for _, h := range r.Headers {
			if h.Key == idem.EventIDHeader {
				ids[string(h.Value)] = true
			}
		}
	}
	if len(recs) != events || len(ids) != events || len(next) != keys {
		t.Fatalf("%d records, %d distinct event ids, %d keys; want %d, %d, %d", len(recs), len(ids), len(next), events, events, keys)
	}
}

// blockingPublisher holds Publish until released, then answers with err.
type blockingPublisher struct {
	entered chan []idem.Message
	release chan error
}

func (p *blockingPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	select {
	case p.entered <- msgs:
	default: // nobody is watching this attempt
	}
	var err error
	select {
	case err = <-p.release:
	case <-ctx.Done(): // the relay's lease on the batch ran out
		err = ctx.Err()
	}
	errs := make([]error, len(msgs))
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// A relay loses leadership (its connection dies) while it is publishing; the
// new leader takes the rows over. The old relay's late "published" mark is
// refused: the rows stay with the new leader's outcome.
func TestLeaseTakeoverRefusesLateMark(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1})

	old := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error)}
	startRelay(t, &idem.Relay{Pool: pool, Publisher: old, PollInterval: 20 * time.Millisecond, Lease: 5 * time.Second})
	if msgs := <-old.entered; len(msgs) != 2 {
		t.Fatalf("old relay claimed %d rows, want 2", len(msgs))
	}
	// Cut the old leader's connection, as a network partition would.
	if n := count(t, pool, `SELECT count(pg_terminate_backend(pid)) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND ((classid::bigint << 32) | objid::bigint) = ((7651::bigint << 32) | 'idem_outbox'::regclass::oid::bigint)`); n != 1 {
		t.Fatalf("terminated %d leader connections, want 1", n)
	}
	// The new leader resets the rows and publishes them; its publish fails,
	// so they go back to PENDING.
	fresh := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error, 1)}
	startRelay(t, &idem.Relay{Pool: pool, Publisher: fresh, PollInterval: 20 * time.Millisecond, MaxAttempts: 100, Lease: 2 * time.Second})
	if msgs := <-fresh.entered; len(msgs) != 2 {
		t.Fatalf("new leader claimed %d rows, want 2", len(msgs))
	}
	fresh.release <- fmt.Errorf("broker down")
	waitUntil(t, "the new leader's failure to be recorded", func() bool { return statusCounts(t, pool)["PENDING"] == 2 || statusCounts(t, pool)["PUBLISHING"] == 2 })
	// Now the old relay's publish "succeeds" and it tries to mark its rows.
	old.release <- nil
	time.Sleep(200 * time.Millisecond)
	if c := statusCounts(t, pool); c["PUBLISHED"] != 0 {
		t.Fatalf("statuses %v: the old relay's late mark was accepted", c)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE last_error = 'broker down'`); n != 2 {
		t.Fatalf("%d rows carry the new leader's outcome, want 2", n)
	}
}

// An event too large for the broker is parked at once; the rest keep
// flowing, in order.
func TestOversizedEventParked(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	enqueue(t, pool, "events",
		keyed{Key: "a", Seq: 0},
		keyed{Key: "big", Seq: 0, Pad: strings.Repeat("x", 2<<20)},
		keyed{Key: "a", Seq: 1},
	)
	startRelay(t, &idem.Relay{Pool: pool, Publisher: publisher(t, addrs), PollInterval: 20 * time.Millisecond})
	recs := readTopic(t, addrs, "events", 2)
	waitUntil(t, "the big event to be parked", func() bool { return statusCounts(t, pool)["PARKED"] == 1 })
	if c := statusCounts(t, pool); c["PUBLISHED"] != 2 {
		t.Fatalf("statuses %v", c)
	}
	if !strings.Contains(string(recs[0].Value), `"seq":0`) || !strings.Contains(string(recs[1].Value), `"seq":1`) {
		t.Fatalf("published out of order: %s, %s", recs[0].Value, recs[1].Value)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED' AND record_key = 'big' AND last_error <> ''`); n != 1 {
		t.Fatal("parked row has no last_error")
	}
}

// A publish that keeps failing is retried up to the attempt budget, then
// parked; it never blocks other rows.
func TestFailingEventParkedAfterBudget(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0})
	failing := &blockingPublisher{entered: make(chan []idem.Message, 10), release: make(chan error, 10)}
	for i := 0; i < 3; i++ {
		failing.release <- fmt.Errorf("attempt %d failed", i+1)
	}
	startRelay(t, &idem.Relay{Pool: pool, Publisher: failing, PollInterval: 20 * time.Millisecond, MaxAttempts: 3})
	waitUntil(t, "the row to be parked", func() bool { return statusCounts(t, pool)["PARKED"] == 1 })
	if n := count(t, pool, `SELECT attempts FROM idem_outbox`); n != 3 {
		t.Fatalf("parked after %d attempts, want 3", n)
	}
}

// Retention deletes old PUBLISHED rows (and processed events) in bounded
// batches, and nothing else.
func TestRetention(t *testing.T) {
	t.Parallel()
	pool := db(t)
	evs := make([]keyed, 25)
	for i := range evs {
		evs[i] = keyed{Key: "k", Seq: i}
	}
	enqueue(t, pool, "events", evs...)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `UPDATE idem_outbox SET status = 'PUBLISHED', published_at = now() - interval '2 hours' WHERE id IN (SELECT id FROM idem_outbox ORDER BY id LIMIT 20)`); err != nil {
		t.Fatal(err)
	}
	store := idem.NewStore(pool)
	if n, err := store.DeletePublished(ctx, time.Hour, 15); err != nil || n != 15 {
		t.Fatalf("first batch deleted %d (%v), want 15", n, err)
	}
	if n, err := store.DeletePublished(ctx, time.Hour, 15); err != nil || n != 5 {
		t.Fatalf("second batch deleted %d (%v), want 5", n, err)
	}
	if c := statusCounts(t, pool); c["PENDING"] != 5 || c["PUBLISHED"] != 0 {
		t.Fatalf("statuses after retention %v", c)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset, processed_at)
		SELECT 'c', g::text, 't', 0, g, now() - interval '40 days' FROM generate_series(1, 12) g`); err != nil {
		t.Fatal(err)
	}
	if n, err := store.DeleteProcessedEvents(ctx, 30*24*time.Hour, 10); err != nil || n != 10 {
		t.Fatalf("deleted %d processed events (%v), want 10", n, err)
	}
}

// The reaper returns a PUBLISHING row whose lease expired (a batch abandoned
// without a takeover) to PENDING, and the relay then publishes it.
func TestReaperReturnsExpiredLease(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	led := make(chan struct{})
	startRelay(t, &idem.Relay{Pool: pool, Publisher: publisher(t, addrs), PollInterval: 20 * time.Millisecond,
		Lease: 200 * time.Millisecond, OnLeader: func() { close(led) }})
	<-led // the takeover reset has run; only the reaper can help now
	if _, err := pool.Exec(context.Background(), `INSERT INTO idem_outbox (topic, record_key, payload, status, claim_token, locked_until, attempts)
		VALUES ('events', 'k', '{"key":"k","seq":0}', 'PUBLISHING', 'ghost', now() - interval '1 second', 1)`); err != nil {
		t.Fatal(err)
	}
	recs := readTopic(t, addrs, "events", 1)
	if !strings.Contains(string(recs[0].Value), `"seq":0`) {
		t.Fatalf("published %s", recs[0].Value)
	}
	waitUntil(t, "the reaped row to be PUBLISHED", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 1 })
}

// Shutdown while a batch is being published: the relay finishes that batch
// and marks it, instead of leaving it PUBLISHING.
func TestRelayShutdownFinishesBatch(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1})
	pub := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error, 1)}
	stop := startRelay(t, &idem.Relay{Pool: pool, Publisher: pub, PollInterval: 20 * time.Millisecond})
	<-pub.entered
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	time.Sleep(100 * time.Millisecond)
	pub.release <- nil // the acks arrive after shutdown began
	<-stopped
	if c := statusCounts(t, pool); c["PUBLISHED"] != 2 {
		t.Fatalf("statuses after shutdown %v, want both rows PUBLISHED", c)
	}
}

// A commit wakes the relay through NOTIFY: with a poll interval of a minute,
// an enqueued event is still published within seconds.
func TestNotifyWakesRelay(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	led := make(chan struct{})
	startRelay(t, &idem.Relay{Pool: pool, Publisher: publisher(t, addrs), PollInterval: time.Minute,
		OnLeader: func() { close(led) }})
	<-led
	time.Sleep(100 * time.Millisecond) // the relay's first (empty) claim is done; it now waits
	start := time.Now()
	enqueue(t, pool, "events", keyed{Key: "k", Seq: 0})
	readTopic(t, addrs, "events", 1)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("published after %v: the commit did not wake the relay", took)
	}
}
