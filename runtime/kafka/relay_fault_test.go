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

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

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
