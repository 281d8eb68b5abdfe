package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
)

// countingPublisher counts the batches in which no message was acked.
type countingPublisher struct {
	inner idem.Publisher
	mu    sync.Mutex
	dead  int // batches with no ack at all
}

func (p *countingPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	errs := p.inner.Publish(ctx, msgs)
	acked := 0
	for _, err := range errs {
		if err == nil {
			acked++
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if acked == 0 {
		p.dead++
	}
	return errs
}

func (p *countingPublisher) deadBatches() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dead
}

// restartableBroker is a one-broker kfake cluster that keeps its log in a
// directory, so it can be stopped and started again on the same port with
// its topics and records, as a broker restart does.
type restartableBroker struct {
	t    testing.TB
	dir  string
	port int
	c    *kfake.Cluster
}

func startBroker(t testing.TB, topics ...string) *restartableBroker {
	t.Helper()
	b := &restartableBroker{t: t, dir: t.TempDir()}
	b.start(kfake.SeedTopics(1, topics...))
	_, port, err := net.SplitHostPort(b.c.ListenAddrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	b.port, _ = strconv.Atoi(port)
	t.Cleanup(func() {
		if b.c != nil {
			b.c.Close()
		}
	})
	return b
}

func (b *restartableBroker) start(opts ...kfake.Opt) {
	b.t.Helper()
	opts = append([]kfake.Opt{kfake.NumBrokers(1), kfake.DataDir(b.dir), kfake.SyncWrites()}, opts...)
	if b.port != 0 {
		opts = append(opts, kfake.Ports(b.port))
	}
	var err error
	for i := 0; i < 50; i++ { // the port may linger briefly after Close
		if b.c, err = kfake.NewCluster(opts...); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	b.t.Fatalf("start kfake: %v", err)
}

func (b *restartableBroker) addrs() []string {
	return []string{net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port))}
}

func (b *restartableBroker) stop() { b.c.Close(); b.c = nil }

// distinctInKeyOrder reads topic from the start until want distinct event
// ids arrived, and checks that, per key, the first delivery of each event is
// in Seq order, starting at from. It returns how many records were
// duplicates.
func distinctInKeyOrder(t testing.TB, addrs []string, topic string, want, from int) (dups int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var recs []*kgo.Record
	ids := map[string]bool{}
	for len(ids) < want {
		f := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d distinct events from %s", len(ids), want, topic)
		}
		for _, r := range f.Records() {
			recs = append(recs, r)
			for _, h := range r.Headers {
				if h.Key == idem.EventIDHeader {
					ids[string(h.Value)] = true
				}
			}
		}
	}
	seen := map[string]bool{}
	next := map[string]int{}
	for _, r := range recs {
		var id string
		for _, h := range r.Headers {
			if h.Key == idem.EventIDHeader {
				id = string(h.Value)
			}
		}
		if seen[id] {
			dups++
			continue // a duplicate: consumers skip it by event id
		}
		seen[id] = true
		var ev keyed
		if err := json.Unmarshal(r.Value, &ev); err != nil {
			t.Fatal(err)
		}
		if _, ok := next[ev.Key]; !ok {
			next[ev.Key] = from
		}
		if ev.Seq != next[ev.Key] {
			t.Fatalf("key %s: first delivery of seq %d came when %d was due: per-key order broken", ev.Key, ev.Seq, next[ev.Key])
		}
		next[ev.Key]++
	}
	if len(seen) != want {
		t.Fatalf("%d distinct events on the topic, want %d", len(seen), want)
	}
	return dups
}

// The broker goes down for longer than every timeout of the relay (many
// publish timeouts and backoffs), then comes back on the same port:
// restarted from its log, or empty with the topic re-created (a new topic
// id: the client first sees UNKNOWN_TOPIC_ID). While it is down, every batch
// fails: last_error is stored, no attempt is charged, nothing is parked.
// Once it is back, every event is published, per-key order holds, and the
// relay keeps serving.
func TestBrokerDownLongerThanEveryTimeoutThenBack(t *testing.T) {
	t.Parallel()
	t.Run("restarted with its log", func(t *testing.T) { t.Parallel(); brokerDownThenBack(t, false) })
	t.Run("restarted empty", func(t *testing.T) { t.Parallel(); brokerDownThenBack(t, true) })
}

func brokerDownThenBack(t *testing.T, empty bool) {
	broker := startBroker(t, "events")
	pool := db(t)
	pub := &countingPublisher{inner: publisher(t, broker.addrs())}
	const maxAttempts = 2
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: 3 * time.Second,
		PublishTimeout: 300 * time.Millisecond, MaxAttempts: maxAttempts, MaxBackoff: 400 * time.Millisecond}))
	seq := map[string]int{}
	add := func(n int) {
		evs := make([]keyed, n)
		for i := range evs {
			k := fmt.Sprintf("k%d", i%3)
			evs[i] = keyed{Key: k, Seq: seq[k]}
			seq[k]++
		}
		enqueue(t, pool, "events", evs...)
	}
	add(6)
	waitUntil(t, "the first events to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 6 })

	broker.stop()
	add(9)
	// Far more failed batches than MaxAttempts: the old relay parked here.
	waitUntil(t, "failed batches while the broker is down", func() bool {
		return pub.deadBatches() >= 3*maxAttempts+2 || statusCounts(t, pool)["PARKED"] > 0
	})
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status <> 'PUBLISHED' AND coalesce(last_error, '') = ''`); n != 0 {
		t.Errorf("%d failing rows have no last_error", n)
	}
	if c := statusCounts(t, pool); c["PARKED"] != 0 || count(t, pool, `SELECT coalesce(max(attempts), 0) FROM idem_outbox`) != 0 {
		t.Fatalf("the outage was charged to the rows: %v, max attempts %d", c, count(t, pool, `SELECT max(attempts) FROM idem_outbox`))
	}

	onTopic, from := 18, 0
	if empty {
		broker.dir = t.TempDir()
		broker.start(kfake.SeedTopics(1, "events"))
		onTopic, from = 12, 2 // the first 6 (seq 0 and 1 of each key) were lost with the old broker's log
	} else {
		broker.start()
	}
	waitUntil(t, "every event to be published after the broker returned", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 15 })
	add(3) // still serving
	dups := distinctInKeyOrder(t, broker.addrs(), "events", onTopic, from)
	t.Logf("%d failed batches during the outage; %d duplicate records after it", pub.deadBatches(), dups)
	waitUntil(t, "the last events to be marked", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 18 })
	if c := statusCounts(t, pool); len(c) != 1 {
		t.Fatalf("statuses %v, want only PUBLISHED", c)
	}
}

// The broker is partitioned away (connections stay open, nothing flows) for
// longer than every timeout, then comes back: no batch waits past the
// publish timeout, nothing is parked or charged, and once the network is
// back every event is published in per-key order.
func TestBrokerBlackholedLongerThanEveryTimeoutThenBack(t *testing.T) {
	t.Parallel()
	c, proxies := faultproxy.KafkaCluster(t, 1, kfake.SeedTopics(1, "events"))
	addrs := c.ListenAddrs()
	pool := db(t)
	pub := &countingPublisher{inner: publisher(t, addrs)}
	const maxAttempts = 2
	startRelay(t, newRelay(t, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond, Lease: 3 * time.Second,
		PublishTimeout: 300 * time.Millisecond, MaxAttempts: maxAttempts, MaxBackoff: 400 * time.Millisecond}))
	feed := newFeed(t, pool, 3)
	feed.add(6)
	waitUntil(t, "the first events to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 6 })

	faultproxy.Each(proxies, (*faultproxy.Proxy).Blackhole)
	feed.add(9)
	waitUntil(t, "failed batches while the broker is unreachable", func() bool {
		return pub.deadBatches() >= 3*maxAttempts+2 || statusCounts(t, pool)["PARKED"] > 0
	})
	if n := count(t, pool, `SELECT count(*) FROM idem_outbox WHERE status <> 'PUBLISHED' AND coalesce(last_error, '') = ''`); n != 0 {
		t.Errorf("%d failing rows have no last_error", n)
	}
	if c := statusCounts(t, pool); c["PARKED"] != 0 || count(t, pool, `SELECT coalesce(max(attempts), 0) FROM idem_outbox`) != 0 {
		t.Fatalf("the outage was charged to the rows: %v", c)
	}
	faultproxy.Each(proxies, (*faultproxy.Proxy).Restore)
	waitUntil(t, "every event to be published after the network returned", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 15 })
	feed.add(3)
	dups := distinctInKeyOrder(t, addrs, "events", 18, 0)
	waitUntil(t, "the last events to be marked", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 18 })
	t.Logf("%d failed batches during the partition; %d duplicate records after it", pub.deadBatches(), dups)
}

// feed enqueues keyed events over keys keys, numbering each key's events.
type feed struct {
	t    testing.TB
	pool *pgxpool.Pool
	keys int
	seq  map[string]int
	n    int
}

func newFeed(t testing.TB, pool *pgxpool.Pool, keys int) *feed {
	return &feed{t: t, pool: pool, keys: keys, seq: map[string]int{}}
}

func (f *feed) add(n int) {
	evs := make([]keyed, n)
	for i := range evs {
		k := fmt.Sprintf("k%d", f.n%f.keys)
		evs[i] = keyed{Key: k, Seq: f.seq[k]}
		f.seq[k]++
		f.n++
	}
	enqueue(f.t, f.pool, "events", evs...)
}

// gatedPublisher holds its first Publish until the test has injected a
// fault, then publishes: the fault hits between produce and mark.
type gatedPublisher struct {
	inner   idem.Publisher
	once    sync.Once
	entered chan struct{}
	proceed chan struct{}
}

func (p *gatedPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	p.once.Do(func() {
		close(p.entered)
		<-p.proceed
	})
	return p.inner.Publish(ctx, msgs)
}

// The relay's database connections are cut, refused (down) or blackholed
// (open but silent) for longer than the lease, right after a batch was
// produced and before it is marked. The marks, the lease renewal, the
// LISTEN connection and the standby's attempts all fail or time out with
// their own bounded contexts; the relay steps down, waits, takes the lease
// again once the database answers, and republishes what it could not mark.
// In the end every event is published (duplicates only), none is parked or
// charged an attempt, and the relay still serves.
func TestRelayDatabaseFaults(t *testing.T) {
	t.Parallel()
	for _, fault := range []struct {
		name  string
		apply func(*faultproxy.Proxy)
	}{
		{"cut", (*faultproxy.Proxy).Cut},
		{"down", (*faultproxy.Proxy).Down},
		{"blackhole", (*faultproxy.Proxy).Blackhole},
	} {
		t.Run(fault.name, func(t *testing.T) {
			t.Parallel()
			addrs := cluster(t, 2, "events")
			dbURL := pgtest.Schema(t)
			pool := poolOn(t, dbURL)
			if err := idem.Migrate(context.Background(), pool); err != nil {
				t.Fatal(err)
			}
			proxy := faultproxy.New(t, faultproxy.PostgresTarget(dbURL))
			relayPool := poolOn(t, proxy.RewriteURL(dbURL))
			const lease = 2 * time.Second
			pub := &gatedPublisher{inner: publisher(t, addrs), entered: make(chan struct{}), proceed: make(chan struct{})}
			relay, err := idem.NewRelay(idem.NewStore(relayPool), pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond,
				Lease: lease, DBTimeout: 500 * time.Millisecond, PublishTimeout: time.Second, MaxBackoff: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			feed := newFeed(t, pool, 4)
			feed.add(20)
			startRelay(t, relay)
			<-pub.entered
			fault.apply(proxy)
			close(pub.proceed)
			feed.add(10)
			time.Sleep(lease + lease/2) // the fault lasts longer than the lease
			proxy.Restore()
			feed.add(5) // still serving
			waitUntil(t, "every event to be published", func() bool { return statusCounts(t, pool)["PUBLISHED"] == 35 })
			if c := statusCounts(t, pool); len(c) != 1 || count(t, pool, `SELECT max(attempts) FROM idem_outbox`) != 0 {
				t.Fatalf("statuses %v, max attempts %d: want only PUBLISHED, none charged", c, count(t, pool, `SELECT max(attempts) FROM idem_outbox`))
			}
			dups := distinctInKeyOrder(t, addrs, "events", 35, 0)
			t.Logf("%s: %d duplicate records", fault.name, dups)
		})
	}
}

func poolOn(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
