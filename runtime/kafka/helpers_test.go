package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// cluster starts an in-process Kafka (kfake) with the topics, each with
// partitions partitions, and returns its addresses.
func cluster(t testing.TB, partitions int32, topics ...string) []string {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// db is a fresh schema with idemgen's tables and an effects table.
func db(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return tracedDB(t, nil)
}

// tracedDB is db with tracer (when not nil) on the pool's connections.
func tracedDB(t testing.TB, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.PoolConfig(t, func(c *pgxpool.Config) {
		if tracer != nil {
			c.ConnConfig.Tracer = tracer
		}
	})
	if err := idem.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	return pool
}

// order is the test event.
type order struct {
	EventID string `json:"event_id"`
	Amount  int64  `json:"amount"`
}

// applyOrder is the handler: one INSERT, the effect the tests count.
func applyOrder(ctx context.Context, tx pgx.Tx, ev order) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, ev.EventID, ev.Amount)
	return err
}

func orderConsumer(topic string, fn func(context.Context, pgx.Tx, order) error) idem.EventHandler {
	return idem.Consume(idem.EventSpec[order]{
		Topic: topic, Context: "billing",
		EventID: func(o order) string { return o.EventID },
	}, fn)
}

func producer(t testing.TB, addrs []string) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func produce(t testing.TB, cl *kgo.Client, recs ...*kgo.Record) {
	t.Helper()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

func orderRecord(topic string, o order) *kgo.Record {
	b, _ := json.Marshal(o)
	return &kgo.Record{Topic: topic, Key: []byte(o.EventID), Value: b}
}

// outcomes counts what the consumer did with each record.
type outcomes struct {
	mu sync.Mutex
	n  map[idem.Outcome]int
}

func (o *outcomes) record(_ *idem.EventHandler, _ *idem.Record, out idem.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[idem.Outcome]int{}
	}
	o.n[out]++
}

func (o *outcomes) total() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := 0
	for _, v := range o.n {
		s += v
	}
	return s
}

func (o *outcomes) get(k idem.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[k]
}

// running is a consumer running in the background.
type running struct {
	c    *kafka.Consumer
	stop context.CancelFunc
	done chan error
}

func startConsumer(t testing.TB, pool *pgxpool.Pool, cfg kafka.ConsumerConfig, out *outcomes, prepare ...func(*kafka.Consumer)) *running {
	t.Helper()
	if cfg.Group == "" {
		cfg.Group = "g"
	}
	cfg.ClientOpts = append(cfg.ClientOpts, kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100*time.Millisecond))
	if out != nil {
		cfg.OnRecord = out.record
	}
	c, err := kafka.NewConsumer(idem.NewStore(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range prepare {
		p(c)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{c: c, stop: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { r.shutdown(t) }) })
	return r
}

func (r *running) shutdown(t testing.TB) {
	t.Helper()
	r.stop()
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("consumer Run: %v", err)
		}
		r.done <- nil // later shutdowns return at once
	case <-time.After(30 * time.Second):
		t.Fatal("consumer did not stop in 30s")
	}
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	return pgtest.Count(t, pool, sql, args...)
}

var eventSeq atomic.Int64

func newID(prefix string) string { return fmt.Sprintf("%s-%d", prefix, eventSeq.Add(1)) }

// committedOffsets returns the group's committed offset per partition of
// topic (-1 where nothing is committed).
func committedOffsets(t testing.TB, addrs []string, group, topic string, partitions int32) map[int32]int64 {
	t.Helper()
	cl := producer(t, addrs)
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = group
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic = topic
	for p := int32(0); p < partitions; p++ {
		rt.Partitions = append(rt.Partitions, p)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(context.Background(), cl)
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	out := map[int32]int64{}
	for _, rt := range resp.Topics {
		for _, p := range rt.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				t.Fatalf("offset fetch %s/%d: %v", rt.Topic, p.Partition, err)
			}
			out[p.Partition] = p.Offset
		}
	}
	return out
}

// endOffsets returns the log end offset of each partition of topic.
func endOffsets(t testing.TB, addrs []string, topic string, partitions int32) map[int32]int64 {
	t.Helper()
	cl := producer(t, addrs)
	req := kmsg.NewPtrListOffsetsRequest()
	rt := kmsg.NewListOffsetsRequestTopic()
	rt.Topic = topic
	for p := int32(0); p < partitions; p++ {
		rp := kmsg.NewListOffsetsRequestTopicPartition()
		rp.Partition = p
		rp.Timestamp = -1 // latest
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(context.Background(), cl)
	if err != nil {
		t.Fatalf("list offsets: %v", err)
	}
	out := map[int32]int64{}
	for _, rt := range resp.Topics {
		for _, p := range rt.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				t.Fatalf("list offsets %s/%d: %v", rt.Topic, p.Partition, err)
			}
			out[p.Partition] = p.Offset
		}
	}
	return out
}

// waitCommitted waits until group's committed offsets on orders are want
// (each, when not nil, runs before every look). It fails on a stall, not on
// a slow machine: no committed offset moved for a minute (the bound these
// waits had in all, which a slow but progressing run under CI's load can
// exceed), or past 5 minutes in all.
func waitCommitted(t *testing.T, addrs []string, group string, partitions int32, want map[int32]int64, what string, each func()) {
	t.Helper()
	const stall = 60 * time.Second
	progress, last := int64(-1), time.Now()
	capAt := time.Now().Add(5 * time.Minute)
	for {
		if each != nil {
			each()
		}
		got := committedOffsets(t, addrs, group, "orders", partitions)
		done := true
		for p, o := range want {
			if got[p] != o {
				done = false
			}
		}
		if done {
			return
		}
		var sum int64
		for _, o := range got {
			sum += o
		}
		if sum != progress {
			progress, last = sum, time.Now()
		}
		if stalled := time.Since(last) > stall; stalled || time.Now().After(capAt) {
			t.Fatalf("waiting for %s: no committed offset moved for %v (%v) or past 5m: committed %v, want %v", what, stall, stalled, got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
