package kafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
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

// newRelay is idem.NewRelay for tests.
func newRelay(t testing.TB, pool *pgxpool.Pool, pub idem.Publisher, cfg idem.RelayConfig) *idem.Relay {
	t.Helper()
	r, err := idem.NewRelay(idem.NewStore(pool), pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
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
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 50 * time.Millisecond}))
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
		startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{BatchSize: 500,
			PollInterval: 50 * time.Millisecond, OnLeader: func() { once.Do(leaders.Done) }}))
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

// The leader loses its lease while it is publishing (as a leader frozen past
// its lease would: here the lease row is expired under it). A standby takes
// over, resets the rows and publishes them; its publish fails, so they go
// back to PENDING with its error. The old leader's publish then "succeeds"
// and its late "published" mark is refused: the rows keep the new leader's
// outcome.
func TestLeaseTakeoverRefusesLateMark(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1})

	// A one-minute lease: the old leader renews only every 20s, so nothing
	// but the takeover below changes its lease during the test.
	old := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error)}
	oldLog := newLogSink()
	startRelay(t, newRelay(t, pool, old, idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: time.Minute, Logger: slog.New(oldLog)}))
	if msgs := <-old.entered; len(msgs) != 2 {
		t.Fatalf("old relay claimed %d rows, want 2", len(msgs))
	}
	if n := count(t, pool, `WITH u AS (UPDATE idem_relay_leader SET expires_at = now() - interval '1 second' RETURNING 1) SELECT count(*) FROM u`); n != 1 {
		t.Fatalf("expired %d leases, want 1", n)
	}
	fresh := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error, 1)}
	startRelay(t, newRelay(t, pool, fresh, idem.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 100, Lease: 2 * time.Second}))
	if msgs := <-fresh.entered; len(msgs) != 2 {
		t.Fatalf("new leader claimed %d rows, want 2", len(msgs))
	}
	fresh.release <- fmt.Errorf("broker down")
	waitUntil(t, "the new leader's failure to be recorded", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PENDING' AND last_error = 'broker down'`) == 2
	})
	// Now the old relay's publish "succeeds" and it tries to mark its rows.
	old.release <- nil
	waitUntil(t, "the old relay's mark to be refused", func() bool {
		return oldLog.has("stepped down", "relay lease lost", "could not be marked") ||
			count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PUBLISHED'`) != 0
	})
	if c := statusCounts(t, pool); c["PUBLISHED"] != 0 {
		t.Fatalf("statuses %v: the old relay's late mark was accepted", c)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE last_error = 'broker down'`); n != 2 {
		t.Fatalf("%d rows carry the new leader's outcome, want 2", n)
	}
}

// logSink is a slog handler that keeps every record's message and
// attributes as text, so a test can wait for what a relay said.
type logSink struct {
	mu    *sync.Mutex
	lines *[]string
	attrs string
}

func newLogSink() *logSink { return &logSink{mu: new(sync.Mutex), lines: new([]string)} }

func (l *logSink) Enabled(context.Context, slog.Level) bool { return true }

func (l *logSink) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message + l.attrs)
	r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.lines = append(*l.lines, b.String())
	return nil
}

func (l *logSink) WithAttrs(as []slog.Attr) slog.Handler {
	c := *l
	for _, a := range as {
		c.attrs += " " + a.String()
	}
	return &c
}

func (l *logSink) WithGroup(string) slog.Handler { return l }

// has reports whether some record contains every one of parts.
func (l *logSink) has(parts ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
next:
	for _, line := range *l.lines {
		for _, p := range parts {
			if !strings.Contains(line, p) {
				continue next
			}
		}
		return true
	}
	return false
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
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
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

// failKeyPublisher fails every message whose key is in fail (with the error
// returned by errFor) and acks the others; it counts its calls.
type failKeyPublisher struct {
	mu     sync.Mutex
	fail   map[string]bool
	errFor func(idem.Message) error
	calls  int
}

func (p *failKeyPublisher) Publish(_ context.Context, msgs []idem.Message) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if p.fail[string(m.Key)] {
			errs[i] = p.errFor(m)
		}
	}
	return errs
}

func (p *failKeyPublisher) callCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

func (p *failKeyPublisher) setFail(key string, fail bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail[key] = fail
}

// A batch in which nothing gets through (the broker is down, as far as the
// relay can tell) is no row's fault: it backs off, stores last_error, and
// charges no attempt, however long it lasts. A row that fails while others
// of its batch are acked uses its budget and is parked after MaxAttempts,
// while the rest keep flowing.
func TestFailingEventParkedOnlyWhenOthersGetThrough(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "bad", Seq: 0})
	pub := &failKeyPublisher{fail: map[string]bool{"bad": true}, errFor: func(idem.Message) error { return errors.New("broker unreachable") }}
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 3, MaxBackoff: 100 * time.Millisecond}))
	waitUntil(t, "six failed publishes of the lone row", func() bool { return pub.callCount() >= 6 || statusCounts(t, pool)["PARKED"] > 0 })
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED' OR attempts <> 0 OR coalesce(last_error, '') <> 'broker unreachable'`); n != 0 {
		t.Fatalf("an outage was charged to the row: %v, attempts %d", statusCounts(t, pool), count(t, pool, `SELECT attempts FROM idem_outbox`))
	}
	// Now others get through in the same batches: each such failure counts.
	// (A good event claimed alone, while the bad one is in flight, makes a
	// round that counts nothing, hence more rounds than MaxAttempts.)
	goods := 0
	for ; statusCounts(t, pool)["PARKED"] == 0; goods++ {
		if goods == 20 {
			t.Fatalf("not parked after 20 good events: attempts %d", count(t, pool, `SELECT attempts FROM idem_outbox WHERE record_key = 'bad'`))
		}
		enqueue(t, pool, "events", keyed{Key: "good", Seq: goods})
		waitUntil(t, "the good event to be published", func() bool {
			return count(t, pool, `SELECT count(*) FROM idem_outbox WHERE record_key = 'good' AND status = 'PUBLISHED'`) == int64(goods+1)
		})
	}
	if goods < 3 {
		t.Fatalf("parked after %d batches with others acked, want at least 3", goods)
	}
	if n := count(t, pool, `SELECT attempts FROM idem_outbox WHERE record_key = 'bad' AND status = 'PARKED' AND last_error = 'broker unreachable'`); n != 3 {
		t.Fatalf("parked after %d attempts, want 3", n)
	}
}

// Error text that PostgreSQL's text type refuses (a NUL byte, invalid
// UTF-8) and very long text are stored sanitized and bounded: recording a
// failure never fails on the failure's own bytes.
func TestPublishErrorTextStoredSanitized(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "bad", Seq: 0})
	pub := &failKeyPublisher{fail: map[string]bool{"bad": true}, errFor: func(idem.Message) error {
		return errors.New("broker said \x00 then \xff\xfe " + strings.Repeat("é", 5000))
	}}
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}))
	waitUntil(t, "last_error to be stored", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem_outbox WHERE last_error LIKE 'broker said \\0 then %'`) == 1
	})
	if n := count(t, pool, `SELECT octet_length(last_error) FROM idem_outbox`); n > 2100 || n < 1000 {
		t.Fatalf("last_error is %d bytes, want it bounded near 2000", n)
	}
}

// Parked rows can be requeued by id, by topic or all at once; they go out
// through the ordinary relay path and end PUBLISHED.
func TestRequeueParked(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "p", Seq: 0}, keyed{Key: "p", Seq: 1}, keyed{Key: "ok", Seq: 0})
	enqueue(t, pool, "other", keyed{Key: "p", Seq: 2})
	pub := &failKeyPublisher{fail: map[string]bool{"p": true}, errFor: func(idem.Message) error { return idem.Permanent(errors.New("record too large")) }}
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
	waitUntil(t, "three rows parked", func() bool { return statusCounts(t, pool)["PARKED"] == 3 })
	pub.setFail("p", false)

	store := idem.NewStore(pool)
	ctx := context.Background()
	first := count(t, pool, `SELECT min(id) FROM idem_outbox WHERE status = 'PARKED'`)
	if n, err := store.RequeueParked(ctx, first, 999999); err != nil || n != 1 {
		t.Fatalf("requeue by id: %d, %v; want 1", n, err)
	}
	waitUntil(t, "the requeued row to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 2 })
	if n, err := store.RequeueParkedTopic(ctx, "other"); err != nil || n != 1 {
		t.Fatalf("requeue topic: %d, %v; want 1", n, err)
	}
	waitUntil(t, "the topic's row to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 3 })
	if n, err := store.RequeueAllParked(ctx); err != nil || n != 1 {
		t.Fatalf("requeue all: %d, %v; want 1", n, err)
	}
	waitUntil(t, "every row to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 4 })
	if n, err := store.RequeueAllParked(ctx); err != nil || n != 0 {
		t.Fatalf("requeue with nothing parked: %d, %v", n, err)
	}
}

// One Relay value run twice at once (a caller's mistake, or two goroutines
// sharing it): no data race, one leads, every event is published once.
func TestRelayRunTwiceAtOnce(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	var leaders atomic.Int32
	r := newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond, OnLeader: func() { leaders.Add(1) }})
	startRelay(t, r)
	startRelay(t, r)
	evs := make([]keyed, 50)
	for i := range evs {
		evs[i] = keyed{Key: "k", Seq: i}
	}
	enqueue(t, pool, "events", evs...)
	recs := readTopic(t, addrs, "events", 50)
	waitUntil(t, "all rows PUBLISHED", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 50 })
	if len(recs) != 50 || leaders.Load() != 1 {
		t.Fatalf("%d records, %d leaders; want 50 and 1", len(recs), leaders.Load())
	}
}

// NewRelay refuses what cannot work, and fills the defaults.
func TestNewRelayValidates(t *testing.T) {
	t.Parallel()
	store := idem.NewStore(db(t))
	pub := &failKeyPublisher{}
	for _, cfg := range []idem.RelayConfig{{Lease: -1}, {BatchSize: -1}, {Lease: time.Millisecond}, {Lease: time.Second, DBTimeout: 2 * time.Second}} {
		if _, err := idem.NewRelay(store, pub, cfg); err == nil {
			t.Errorf("NewRelay(%+v) accepted", cfg)
		}
	}
	if _, err := idem.NewRelay(nil, pub, idem.RelayConfig{}); err == nil {
		t.Error("NewRelay accepted a nil store")
	}
	if _, err := idem.NewRelay(store, nil, idem.RelayConfig{}); err == nil {
		t.Error("NewRelay accepted a nil publisher")
	}
	r, err := idem.NewRelay(store, pub, idem.RelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if c := r.Config(); c.Lease != 15*time.Second || c.BatchSize != 500 || c.MaxAttempts != 10 || c.DBTimeout != 5*time.Second {
		t.Fatalf("defaults %+v", c)
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
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond,
		Lease: time.Second, OnLeader: sync.OnceFunc(func() { close(led) })}))
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
	stop := startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
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
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: time.Minute,
		OnLeader: sync.OnceFunc(func() { close(led) })}))
	<-led
	time.Sleep(100 * time.Millisecond) // the relay's first (empty) claim is done; it now waits
	start := time.Now()
	enqueue(t, pool, "events", keyed{Key: "k", Seq: 0})
	readTopic(t, addrs, "events", 1)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("published after %v: the commit did not wake the relay", took)
	}
}

// A leader that stops cleanly releases its lease: a standby takes over at
// once, long before the (one-minute) lease would have expired.
func TestCleanShutdownHandsOverAtOnce(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	led := make(chan string, 2)
	secondLog := newLogSink()
	cfg := func(name string) idem.RelayConfig {
		return idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: time.Minute, OnLeader: func() { led <- name },
			Logger: slog.New(secondLog)}
	}
	stopFirst := startRelay(t, newRelay(t, pool, publisher(t, addrs), cfg("first")))
	if who := <-led; who != "first" {
		t.Fatalf("%s led first", who)
	}
	startRelay(t, newRelay(t, pool, publisher(t, addrs), cfg("second")))
	// The second must already be standing by (it saw the first's live
	// lease), or it would simply find the lease released when it first
	// looks, and the test would pass without any hand-over.
	waitUntil(t, "the second relay to stand by", func() bool { return secondLog.has("standing by") })
	stopFirst()
	select {
	case who := <-led:
		if who != "second" {
			t.Fatalf("%s led after the first stopped", who)
		}
	case <-time.After(30 * time.Second): // half the lease
		t.Fatal("the standby did not take over within half the lease: the lease was not released")
	}
	enqueue(t, pool, "events", keyed{Key: "k", Seq: 0})
	readTopic(t, addrs, "events", 1)
}
