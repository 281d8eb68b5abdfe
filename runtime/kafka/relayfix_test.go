package kafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/relayhook"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// Events for a topic that does not exist must not hold back the events of
// other topics forever, even when they fill whole batches: the broker
// answers (the topic is unknown), so this is no outage. The missing topic's
// rows carry a last_error naming the topic, and end PARKED after their
// attempt budget; every other event is published.
//
// franz-go fails a record for an unknown topic after UnknownTopicRetries (4)
// metadata answers, which it asks for at most once per MetadataMinAge
// (default 5s): about 12s per publish of a missing-topic batch, 57s for the
// whole test. The publisher here asks every 100ms: the same answers and the
// same error, sooner.
func TestMissingTopicDoesNotBlockOtherTopics(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	pub, err := kafka.NewPublisher(addrs, kgo.MetadataMinAge(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	var missing []keyed
	for i := range 6 {
		missing = append(missing, keyed{Key: "m", Seq: i})
	}
	enqueue(t, pool, "no-such-topic", missing...)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1}, keyed{Key: "b", Seq: 0})
	logs := newLogSink()
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{
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
	// 2s: a lease statement is bounded by lease/3, and a leader whose
	// renewal times out steps down by itself; at 1s (333ms) a loaded
	// machine did that between two freezes.
	const lease = 2 * time.Second
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
	for range 5 {
		// The leader is the lease's live holder, not assumed to alternate:
		// a leader can also lose its lease on its own (a renewal that timed
		// out), and freezing the standby instead then waited in vain.
		leader, standby := leaderOf(t, pool, procs), (*relayProc)(nil)
		for _, p := range procs {
			if p != leader {
				standby = p
			}
		}
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

// leaderOf returns the process of procs whose relay holds the live lease,
// waiting up to 30s for one to hold it.
func leaderOf(t *testing.T, pool *pgxpool.Pool, procs []*relayProc) *relayProc {
	t.Helper()
	id := regexp.MustCompile(`relay=([0-9a-f]{8})`)
	var holder string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		err := pool.QueryRow(context.Background(), `SELECT left(holder, 8) FROM idem_relay_leader WHERE expires_at > now()`).Scan(&holder)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range procs {
			if m := id.FindStringSubmatch(p.text()); m != nil && m[1] == holder {
				return p
			}
		}
	}
	t.Fatalf("no relay of %d holds a live lease (last holder %q)", len(procs), holder)
	return nil
}

// span is one Publish call of one relay.
type span struct {
	relay      string
	start, end time.Time
	n          int
}

// spanLog records every Publish call of several relays.
type spanLog struct {
	mu    sync.Mutex
	spans []span
}

// spanPublisher records each Publish call's span in log under name.
type spanPublisher struct {
	name  string
	inner idem.Publisher
	log   *spanLog
}

func (p *spanPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	s := span{relay: p.name, start: time.Now(), n: len(msgs)}
	errs := p.inner.Publish(ctx, msgs)
	s.end = time.Now()
	p.log.mu.Lock()
	p.log.spans = append(p.log.spans, s)
	p.log.mu.Unlock()
	return errs
}

// overlaps returns a description of the first two Publish calls of different
// relays that ran at the same time: two leaders producing at once.
func (l *spanLog) overlaps() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, a := range l.spans {
		for _, b := range l.spans[i+1:] {
			if a.relay != b.relay && a.start.Before(b.end) && b.start.Before(a.end) {
				return fmt.Sprintf("%s published %d rows over [%v, %v] while %s published %d over [%v, %v]",
					a.relay, a.n, a.start.Format("15:04:05.000"), a.end.Format("15:04:05.000"),
					b.relay, b.n, b.start.Format("15:04:05.000"), b.end.Format("15:04:05.000"))
			}
		}
	}
	return ""
}

func (l *spanLog) lastStart(relay string) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	var t time.Time
	for _, s := range l.spans {
		if s.relay == relay && s.start.After(t) {
			t = s.start
		}
	}
	return t
}

// Two relays, each on its own proxied connection to PostgreSQL, both with a
// working broker. The leader's database link is blackholed (connections stay
// open, nothing flows), or its lease renewals are made to flap around their
// timeout with latency toggled just below and above it. The standby takes
// over; the old leader, once it notices, never publishes again while the
// other leads: no two relays ever publish at the same time. An independent
// consumer sees every event, each key's first deliveries in order.
func TestLeaderDatabaseFaultNoSplitBrain(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fault func(t *testing.T, p *faultproxy.Proxy)
	}{
		{"blackhole", func(t *testing.T, p *faultproxy.Proxy) {
			p.Blackhole()
			time.Sleep(3 * time.Second)
			p.Restore()
		}},
		{"flapping-latency", func(t *testing.T, p *faultproxy.Proxy) {
			// A renewal is 4 round trips (BEGIN, SET, UPDATE, COMMIT),
			// each ≥ 2× the latency: 30ms → ~240ms, 45ms → ~360ms,
			// around the 300ms lease-statement timeout.
			for i := range 16 {
				p.Latency(time.Duration(30+15*(i%2)) * time.Millisecond)
				time.Sleep(250 * time.Millisecond)
			}
			p.Restore()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			addrs := cluster(t, 4, "events")
			rec := startRecorder(t, addrs, "events")
			dbURL := pgtest.Schema(t)
			pool := poolOn(t, dbURL)
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			spans := &spanLog{}
			type relayUnderTest struct {
				proxy *faultproxy.Proxy
				led   chan time.Time
				logs  *logSink
			}
			start := func(name string) *relayUnderTest {
				r := &relayUnderTest{proxy: faultproxy.New(t, faultproxy.PostgresTarget(dbURL)), led: make(chan time.Time, 100), logs: newLogSink()}
				relay, err := idem.NewRelay(idem.NewStore(poolOn(t, r.proxy.RewriteURL(dbURL))),
					&spanPublisher{name: name, inner: publisher(t, addrs), log: spans},
					idem.RelayConfig{Lease: time.Second, DBTimeout: 300 * time.Millisecond, PublishTimeout: time.Second,
						PollInterval: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, BatchSize: 20,
						Logger: slog.New(r.logs), OnLeader: func() { r.led <- time.Now() }})
				if err != nil {
					t.Fatal(err)
				}
				startRelay(t, relay)
				return r
			}
			stopFeed := feedKeys(t, pool, 20)
			a := start("A")
			<-a.led
			b := start("B")
			waitUntil(t, "B to stand by", func() bool { return b.logs.has("standing by") })
			waitUntil(t, "A to publish", func() bool { return statusCounts(t, pool)["PUBLISHED"] >= 40 })
			faultAt := time.Now()
			tc.fault(t, a.proxy)
			total := stopFeed()
			waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == int64(total) })
			waitUntil(t, "the consumer to see every event", func() bool { return rec.distinct() == total })
			dups := rec.check(t, total)
			if o := spans.overlaps(); o != "" {
				t.Fatalf("split brain: %s", o)
			}
			if c := statusCounts(t, pool); len(c) != 1 {
				t.Fatalf("statuses %v, want only PUBLISHED", c)
			}
			var bLed []string
			for len(b.led) > 0 {
				bLed = append(bLed, (<-b.led).Sub(faultAt).Round(time.Millisecond).String())
			}
			var aLed int
			for len(a.led) > 0 {
				<-a.led
				aLed++
			}
			t.Logf("%s: B became leader at %v after the fault began; A led again %d times; %d events, %d duplicates",
				tc.name, bLed, aLed, total, dups)
			if tc.name == "blackhole" && len(bLed) == 0 {
				t.Fatal("the standby never took over from a leader whose database link was blackholed")
			}
		})
	}
}

// Requeueing a row that is not PARKED (pending, being published, published)
// changes nothing, by id, by topic or all at once.
func TestRequeueNotParkedIsNoOp(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1}, keyed{Key: "a", Seq: 2})
	pgtest.Exec(t, pool, `UPDATE idem_outbox SET status = 'PUBLISHING', claim_token = 'tok', locked_until = now() + interval '1 hour', attempts = 2, last_error = 'x' WHERE id = (SELECT min(id) + 1 FROM idem_outbox)`)
	pgtest.Exec(t, pool, `UPDATE idem_outbox SET status = 'PUBLISHED', published_at = now() WHERE id = (SELECT max(id) FROM idem_outbox)`)
	snapshot := func() string {
		var s string
		if err := pool.QueryRow(context.Background(), `SELECT string_agg(concat_ws(',', id, status, attempts, claim_token, locked_until, last_error, published_at), ';' ORDER BY id) FROM idem_outbox`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()
	store := idem.NewStore(pool)
	ctx := context.Background()
	ids := []int64{count(t, pool, `SELECT min(id) FROM idem_outbox`), count(t, pool, `SELECT min(id) + 1 FROM idem_outbox`), count(t, pool, `SELECT max(id) FROM idem_outbox`)}
	for name, requeue := range map[string]func() (int64, error){
		"ids":   func() (int64, error) { return store.RequeueParked(ctx, ids...) },
		"none":  func() (int64, error) { return store.RequeueParked(ctx) },
		"topic": func() (int64, error) { return store.RequeueParkedTopic(ctx, "events") },
		"all":   func() (int64, error) { return store.RequeueAllParked(ctx) },
	} {
		if n, err := requeue(); err != nil || n != 0 {
			t.Fatalf("requeue %s of rows that are not parked: %d, %v; want 0", name, n, err)
		}
	}
	if after := snapshot(); after != before {
		t.Fatalf("requeue changed rows that were not parked:\nbefore %s\nafter  %s", before, after)
	}
}

// Requeueing parked rows while the relay keeps parking and publishing: a
// requeue that commits while a batch is in flight (claimed, PUBLISHING
// under the relay's token) requeues exactly the rows that were parked and
// leaves the batch's rows alone, and the requeued rows go out again through
// the relay (claimed, failed, parked again with a fresh attempt budget).
// That interleaving is forced on every run: the relay is held right after
// each claim (relayhook.OnClaimed) while the test requeues. Then requeues
// run freely, over and over, while enqueues continue: no row is lost or
// left in PUBLISHING, and once the fault is gone a last requeue publishes
// all.
func TestRequeueParkedRacingRelay(t *testing.T) {
	t.Parallel()
	pool := db(t)
	pub := &failKeyPublisher{fail: map[string]bool{"p": true}, errFor: func(idem.Message) error { return idem.Permanent(errors.New("record too large")) }}
	relay := newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 5 * time.Millisecond})
	var hold atomic.Bool // hold the next claimed batch until resumed
	claimed := make(chan []int64)
	resume := make(chan struct{})
	stopped := make(chan struct{})
	relayhook.OnClaimed(relay, func(ids []int64) {
		if !hold.Load() {
			return
		}
		select {
		case claimed <- ids:
		case <-stopped:
			return
		}
		select {
		case <-resume:
		case <-stopped:
		}
	})
	startRelay(t, relay)
	t.Cleanup(func() { close(stopped) }) // runs first: a held batch is let go before the relay stops
	store := idem.NewStore(pool)
	rows := func(ids []int64) string {
		var s string
		if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(concat_ws(',', id, status, attempts, claim_token, locked_until), ';' ORDER BY id), '') FROM idem_outbox WHERE id = ANY($1)`, ids).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	idsWhere := func(cond string) []int64 {
		var ids []int64
		if err := pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM idem_outbox WHERE `+cond).Scan(&ids); err != nil {
			t.Fatal(err)
		}
		return ids
	}

	// The forced race: each round enqueues one failing and one good event;
	// the relay claims them and is held; the test requeues every parked row
	// (those of earlier rounds) and checks the batch in flight is untouched;
	// then the relay goes on and everything settles before the next round.
	const rounds = 5
	var races int
	for i := range rounds {
		hold.Store(true)
		enqueue(t, pool, "events", keyed{Key: "p", Seq: i}, keyed{Key: "ok", Seq: i})
		var batch []int64
		select {
		case batch = <-claimed:
		case <-time.After(60 * time.Second):
			t.Fatalf("round %d: the relay held no claimed batch (relayhook.OnClaimed) within 60s: %v", i, statusCounts(t, pool))
		}
		hold.Store(false) // the requeued rows' batch goes through
		if inFlight := idsWhere(`status = 'PUBLISHING' AND claim_token IS NOT NULL`); len(batch) != 2 || fmt.Sprint(inFlight) != fmt.Sprint(batch) {
			t.Fatalf("round %d: the held batch is %v, the PUBLISHING rows %v; want the round's 2 new rows", i, batch, inFlight)
		}
		parked := idsWhere(`status = 'PARKED'`)
		if len(parked) != i {
			t.Fatalf("round %d: %d rows parked before the requeue, want %d: %v", i, len(parked), i, statusCounts(t, pool))
		}
		before := rows(batch)
		n, err := store.RequeueAllParked(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if after := rows(batch); after != before {
			t.Fatalf("round %d: a requeue changed the rows of the batch in flight:\nbefore %s\nafter  %s", i, before, after)
		}
		if n != int64(len(parked)) {
			t.Fatalf("round %d: the requeue with a batch in flight requeued %d rows; %d were parked", i, n, len(parked))
		}
		if got := idsWhere(`status = 'PENDING' AND attempts = 0 AND claim_token IS NULL`); fmt.Sprint(got) != fmt.Sprint(parked) {
			t.Fatalf("round %d: after the requeue the PENDING rows with a fresh budget are %v; want the parked ones %v", i, got, parked)
		}
		if n > 0 {
			races++
		}
		resume <- struct{}{}
		waitUntil(t, fmt.Sprintf("round %d to settle", i), func() bool {
			c := statusCounts(t, pool)
			return c["PUBLISHED"] == int64(i+1) && c["PARKED"] == int64(i+1) && c["PENDING"] == 0 && c["PUBLISHING"] == 0
		})
		// The requeued rows went through the relay once more: each parked
		// row failed exactly once since its last requeue.
		if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED' AND attempts = 1`); n != int64(i+1) {
			t.Fatalf("round %d: %d of %d parked rows have attempts = 1: %s", i, n, i+1, rows(idsWhere(`status = 'PARKED'`)))
		}
	}
	if races != rounds-1 {
		t.Fatalf("%d requeues with a batch in flight found parked rows; want %d", races, rounds-1)
	}

	// Free-running: requeues over and over while events keep coming. The
	// rows parked above are there from the start, so the first requeue
	// already races the relay; the wait below includes it in any case.
	ctx, cancel := context.WithCancel(context.Background())
	var requeued atomic.Int64
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done }) // before the pool closes
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			n, err := store.RequeueAllParked(ctx)
			if err != nil && ctx.Err() == nil {
				t.Errorf("requeue: %v", err)
				return
			}
			requeued.Add(n)
			time.Sleep(10 * time.Millisecond)
		}
	}()
	const events = rounds + 100
	for i := rounds; i < events; i++ {
		enqueue(t, pool, "events", keyed{Key: "p", Seq: i}, keyed{Key: "ok", Seq: i})
	}
	waitUntil(t, "the good events to be published and a requeue to have run meanwhile", func() bool {
		return requeued.Load() > 0 && count(t, pool, `SELECT count(*) FROM idem_outbox WHERE record_key = 'ok' AND status = 'PUBLISHED'`) == events
	})
	cancel()
	<-done
	pub.setFail("p", false)
	waitUntil(t, "no row in flight", func() bool { return statusCounts(t, pool)["PUBLISHING"] == 0 })
	if _, err := store.RequeueAllParked(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 2*events })
	t.Logf("%d forced requeues with a batch in flight; %d rows requeued while the relay ran freely", races, requeued.Load())
}

// Outbox rows whose key and payload hold bytes text columns refuse (NUL,
// invalid UTF-8), and headers beyond Enqueue's (rows written by another
// writer: unicode, non-string values), reach the broker byte for byte: no
// header is silently dropped. Headers that are not a JSON object cannot be
// sent as meant: that row is parked with a last_error saying so, and the
// rest flow.
func TestOutboxRawBytesAndHeaders(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "events")
	pool := db(t)
	pgtest.Exec(t, pool, `INSERT INTO idem_outbox (topic, record_key, payload, headers) VALUES
		('events', '\x00ff00fe'::bytea, '\x00ff7b00'::bytea, '{"trace": "a\u00e9b", "n": 1, "obj": {"x": [true]}}'),
		('events', NULL, '\x'::bytea, '{}'),
		('events', 'bad'::bytea, 'v'::bytea, '["not", "an", "object"]'),
		('events', 'after'::bytea, 'w'::bytea, '{}')`)
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
	recs := readTopic(t, addrs, "events", 3)
	waitUntil(t, "the malformed row to be parked", func() bool { return statusCounts(t, pool)["PARKED"] == 1 })
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status = 'PARKED' AND record_key = 'bad' AND last_error LIKE '%headers%'`); n != 1 {
		t.Fatalf("the row with malformed headers is not parked with a last_error about its headers: %v", statusCounts(t, pool))
	}
	r := recs[0]
	if string(r.Key) != "\x00\xff\x00\xfe" || string(r.Value) != "\x00\xff{\x00" {
		t.Fatalf("bytes changed on the way: key %q value %q", r.Key, r.Value)
	}
	got := map[string]string{}
	for _, h := range r.Headers {
		got[h.Key] = string(h.Value)
	}
	if got["trace"] != "aéb" || got["n"] != "1" || got["obj"] != `{"x": [true]}` || got[idem.EventIDHeader] == "" {
		t.Fatalf("headers %q", got)
	}
	if recs[1].Key != nil || len(recs[1].Value) != 0 || string(recs[2].Key) != "after" {
		t.Fatalf("second and third records: key %q value %q, key %q", recs[1].Key, recs[1].Value, recs[2].Key)
	}
}

// A shutdown while the broker, or the database, is blackholed (connections
// open, nothing answers) returns within a bound set by the configuration
// (PublishTimeout + Lease + DBTimeout, plus slack for a loaded machine), the
// publisher's client included; nothing is lost: a relay started after the
// network returns publishes every event, in per-key order.
func TestShutdownDuringBlackhole(t *testing.T) {
	t.Parallel()
	for _, side := range []string{"broker", "database"} {
		t.Run(side, func(t *testing.T) {
			t.Parallel()
			c, brokerProxies := faultproxy.KafkaCluster(t, 1, kfake.SeedTopics(2, "events"))
			addrs := c.ListenAddrs()
			rec := startRecorder(t, addrs, "events")
			dbURL := pgtest.Schema(t)
			pool := poolOn(t, dbURL)
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			dbProxy := faultproxy.New(t, faultproxy.PostgresTarget(dbURL))
			cfg := idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: 2 * time.Second, DBTimeout: 500 * time.Millisecond,
				PublishTimeout: time.Second, MaxBackoff: 300 * time.Millisecond}
			pub, err := kafka.NewPublisher(addrs)
			if err != nil {
				t.Fatal(err)
			}
			logs := newLogSink()
			cfg.Logger = slog.New(logs)
			relay := newRelay(t, poolOn(t, dbProxy.RewriteURL(dbURL)), pub, cfg)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { _ = relay.Run(ctx); pub.Close(); close(done) }()
			feed := newFeed(t, pool, 4)
			feed.add(10)
			waitUntil(t, "the first events to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 10 })
			if side == "broker" {
				faultproxy.Each(brokerProxies, (*faultproxy.Proxy).Blackhole)
				feed.add(10)
				waitUntil(t, "the relay to see the outage", func() bool { return logs.has("broker outage") })
				feed.add(5) // a batch is likely in flight when the shutdown comes
			} else {
				feed.add(10)
				dbProxy.Blackhole()
				feed.add(5)
				time.Sleep(cfg.DBTimeout) // statements are now stuck
			}
			stopAt := time.Now()
			cancel()
			bound := cfg.PublishTimeout + cfg.Lease + cfg.DBTimeout + 5*time.Second
			select {
			case <-done:
			case <-time.After(bound):
				t.Fatalf("Run and Publisher.Close did not return within %v of the shutdown", bound)
			}
			took := time.Since(stopAt)
			faultproxy.Each(brokerProxies, (*faultproxy.Proxy).Restore)
			dbProxy.Restore()
			startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: 2 * time.Second}))
			waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 25 })
			waitUntil(t, "the consumer to see every event", func() bool { return rec.distinct() == 25 })
			dups := rec.check(t, 25)
			t.Logf("%s blackholed: shutdown returned after %v (bound %v); %d duplicates", side, took.Round(time.Millisecond), bound, dups)
		})
	}
}

// The old leader's late mark comes while the new leader has the same rows
// claimed and in flight (PUBLISHING, under its own token): the mark must be
// refused by the token, not merely by the rows' status. (In
// TestLeaseTakeoverRefusesLateMark the rows are back to PENDING when the
// late mark comes, so a mark without the token condition passes it too.)
func TestLateMarkRefusedWhileNewLeaderPublishes(t *testing.T) {
	t.Parallel()
	pool := db(t)
	enqueue(t, pool, "events", keyed{Key: "a", Seq: 0}, keyed{Key: "a", Seq: 1})
	old := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error)}
	oldLog := newLogSink()
	startRelay(t, newRelay(t, pool, old, idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: time.Minute, Logger: slog.New(oldLog)}))
	if msgs := <-old.entered; len(msgs) != 2 {
		t.Fatalf("old relay claimed %d rows, want 2", len(msgs))
	}
	// The old leader's lease expires under it (as if it had been frozen).
	if n := count(t, pool, `WITH u AS (UPDATE idem_relay_leader SET expires_at = now() - interval '1 second' RETURNING 1) SELECT count(*) FROM u`); n != 1 {
		t.Fatalf("expired %d leases, want 1", n)
	}
	fresh := &blockingPublisher{entered: make(chan []idem.Message, 1), release: make(chan error, 1)}
	startRelay(t, newRelay(t, pool, fresh, idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: time.Minute, PublishTimeout: time.Minute}))
	t.Cleanup(func() { // let the new leader's publish end if the test fails
		select {
		case fresh.release <- nil:
		default:
		}
	})
	if msgs := <-fresh.entered; len(msgs) != 2 {
		t.Fatalf("new leader claimed %d rows, want 2", len(msgs))
	}
	// Both have the rows in hand; the old one's publish "succeeds" first.
	old.release <- nil
	waitUntil(t, "the old relay's mark to be refused or accepted", func() bool {
		return oldLog.has("could not be marked") || statusCounts(t, pool)["PUBLISHED"] != 0
	})
	if c := statusCounts(t, pool); c["PUBLISHING"] != 2 {
		t.Fatalf("statuses %v: the old leader's late mark changed rows the new leader holds", c)
	}
	fresh.release <- nil
	waitUntil(t, "the new leader's mark", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 2 })
}

// A leader frozen right after claiming a batch, before producing it (the
// process stops itself there), is replaced when its lease expires; the new
// leader publishes everything. Woken (SIGCONT), the old leader must find its
// lease gone before producing: not one record of the topic comes from it.
func TestLeaderFrozenBetweenClaimAndProduceNeverProduces(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	addrs := cluster(t, 2, "events")
	rec := startRecorder(t, addrs, "events")
	dbURL := pgtest.Schema(t)
	pool := poolOn(t, dbURL)
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	feed := newFeed(t, pool, 4)
	feed.add(20)
	a := startRelayProc(t, "A", dbURL, addrs, lease, "IDEM_TAG=A", "IDEM_STOP_AFTER_CLAIM=1")
	a.waitFor(t, 0, 30*time.Second, "CLAIMED")
	b := startRelayProc(t, "B", dbURL, addrs, lease, "IDEM_TAG=B")
	b.waitFor(t, 0, 30*time.Second, "LEADING")
	waitUntil(t, "B to publish everything", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 20 })
	// The batch A claimed in its frozen term is among these 20. Once awake,
	// A may lead again in a new term (if B's lease lapses on a loaded
	// machine) and then legitimately publish newer events; what it must
	// never do is produce what it claimed in the term it lost.
	frozenTerm := map[string]bool{}
	rows, err := pool.Query(context.Background(), `SELECT event_id FROM idem_outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		frozenTerm[id] = true
	}
	if err := rows.Err(); err != nil || len(frozenTerm) != 20 {
		t.Fatalf("%d event ids before the wake-up (%v), want 20", len(frozenTerm), err)
	}
	from := strings.Count(a.text(), "\n") + 1
	a.signal(t, syscall.SIGCONT)
	a.waitFor(t, from, 30*time.Second, "relay stepped down")
	feed.add(4) // B still leads and publishes
	waitUntil(t, "the new events", func() bool { return rec.distinct() == 24 })
	time.Sleep(time.Second) // anything A produced on waking has landed by now
	rec.check(t, 24)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, r := range rec.recs {
		if id := header(r, idem.EventIDHeader); header(r, "relay-proc") == "A" && frozenTerm[id] {
			t.Fatalf("the frozen leader produced event %s of the batch it claimed before freezing, its lease long gone", id)
		}
	}
}

// The topic is deleted under a running relay and re-created a few seconds
// later (new topic id), while events keep coming: nothing is parked (a
// topic missing for a few seconds uses a few attempts at most), every event
// enqueued after the deletion reaches the new topic, and per key the first
// deliveries there are in order.
func TestTopicDeletedAndRecreated(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "events")
	pool := db(t)
	admin, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	startRelay(t, newRelay(t, pool, publisher(t, addrs), idem.RelayConfig{PollInterval: 20 * time.Millisecond,
		PublishTimeout: 2 * time.Second, MaxBackoff: 300 * time.Millisecond}))
	feed := newFeed(t, pool, 4)
	feed.add(8)
	waitUntil(t, "the first events", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 8 })

	ctx := context.Background()
	del := kmsg.NewPtrDeleteTopicsRequest()
	dt := kmsg.NewDeleteTopicsRequestTopic()
	dt.Topic = kmsg.StringPtr("events")
	del.Topics = append(del.Topics, dt)
	del.TopicNames = []string{"events"}
	if resp, err := del.RequestWith(ctx, admin); err != nil || resp.Topics[0].ErrorCode != 0 {
		t.Fatalf("delete topic: %v %+v", err, resp)
	}
	feed.add(8)
	time.Sleep(3 * time.Second)
	create := kmsg.NewPtrCreateTopicsRequest()
	ct := kmsg.NewCreateTopicsRequestTopic()
	ct.Topic, ct.NumPartitions, ct.ReplicationFactor = "events", 2, 1
	create.Topics = append(create.Topics, ct)
	if resp, err := create.RequestWith(ctx, admin); err != nil || resp.Topics[0].ErrorCode != 0 {
		t.Fatalf("create topic: %v %+v", err, resp)
	}
	feed.add(8)
	waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 24 })
	if c := statusCounts(t, pool); len(c) != 1 {
		t.Fatalf("statuses %v, want only PUBLISHED", c)
	}
	recs := readTopic(t, addrs, "events", 16)
	seen := map[string]bool{}
	last := map[string]int{}
	for _, r := range recs {
		id := header(r, idem.EventIDHeader)
		if seen[id] {
			continue
		}
		seen[id] = true
		var ev keyed
		if err := json.Unmarshal(r.Value, &ev); err != nil {
			t.Fatal(err)
		}
		if prev, ok := last[ev.Key]; ok && ev.Seq != prev+1 {
			t.Fatalf("key %s: seq %d first delivered after %d on the new topic", ev.Key, ev.Seq, prev)
		}
		last[ev.Key] = ev.Seq
	}
	for k, s := range last {
		if s != 5 { // 6 events per key; the last two batches (16) all reached the new topic
			t.Fatalf("key %s: last seq on the new topic %d, want 5", k, s)
		}
	}
	t.Logf("max attempts charged: %d", count(t, pool, `SELECT max(attempts) FROM idem_outbox`))
}

// unreachablePublisher fails every message as a relay cut off from the
// broker sees it (nothing acked, a transport error), until healed.
type unreachablePublisher struct {
	inner  idem.Publisher
	healed atomic.Bool
}

func (p *unreachablePublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	if p.healed.Load() {
		return p.inner.Publish(ctx, msgs)
	}
	errs := make([]error, len(msgs))
	for i := range errs {
		errs[i] = errors.New("dial tcp 10.0.0.1:9092: i/o timeout")
	}
	return errs
}

// The leader is partitioned from the broker while its database is fine and
// a standby reaches the broker: after two leases of unbroken outage the
// leader hands the lease over, the standby publishes everything, nothing
// is charged or parked. (Before, the leader kept its lease for as long as
// its own path to the broker was down, and nothing was published.)
func TestLeaderCutOffFromBrokerHandsOver(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 2, "events")
	pool := db(t)
	cfg := func(led chan<- string, name string) idem.RelayConfig {
		return idem.RelayConfig{Lease: time.Second, PollInterval: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
			OnLeader: func() { led <- name }}
	}
	led := make(chan string, 10)
	cut := &unreachablePublisher{inner: publisher(t, addrs)}
	startRelay(t, newRelay(t, pool, cut, cfg(led, "cut off")))
	if who := <-led; who != "cut off" {
		t.Fatalf("%s led first", who)
	}
	startRelay(t, newRelay(t, pool, publisher(t, addrs), cfg(led, "connected")))
	feed := newFeed(t, pool, 4)
	feed.add(20)
	start := time.Now()
	waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 20 })
	t.Logf("published %v after the events were enqueued (lease 1s)", time.Since(start).Round(time.Millisecond))
	if c := statusCounts(t, pool); len(c) != 1 || count(t, pool, `SELECT max(attempts) FROM idem_outbox`) != 0 {
		t.Fatalf("statuses %v: want only PUBLISHED, nothing charged", c)
	}
	distinctInKeyOrder(t, addrs, "events", 20, 0)
}
