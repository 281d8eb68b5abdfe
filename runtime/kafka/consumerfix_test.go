package kafka_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// Outside review of issue 8 (consumer side). These tests produce with their
// own kgo client (not the package's helpers): what an outsider's producer
// may put on the wire, the consumer must survive.

// outsiderProducer is an independent producer: manual partitioning, large
// batches allowed, no idempotence (so nothing is rewritten for us).
func outsiderProducer(t *testing.T, addrs []string) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchMaxBytes(8<<20), kgo.DisableIdempotentWrite())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// byContext records outcomes per (context, offset).
type byContext struct {
	mu sync.Mutex
	m  map[string]idem.Outcome
}

func (b *byContext) record(h *idem.EventHandler, rec *idem.Record, o idem.Outcome) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.m == nil {
		b.m = map[string]idem.Outcome{}
	}
	b.m[fmt.Sprintf("%s/%s/%d", h.Context, rec.Topic, rec.Offset)] = o
}

func (b *byContext) get(key string) idem.Outcome {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.m[key]
}

// Bad bytes from an outsider, through both id forms at once (a handler with
// id=field and one reading the idem-event-id header, on the same topic): a
// 1 MiB value full of NULs, header keys with NUL and invalid UTF-8, 1000
// headers, event ids with NUL, invalid UTF-8, and 10 KB of incompressible
// text. Each ends applied or dead-lettered with its raw bytes, and the
// record after them is applied in both contexts.
func TestOutsiderBadBytes(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 10} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "bytes"),
				kfake.BrokerConfigs(map[string]string{"message.max.bytes": fmt.Sprint(8 << 20)}))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(c.Close)
			addrs := c.ListenAddrs()
			pool := db(t)

			big := bytes.Repeat([]byte("\x00\xff\x00A"), (1<<20)/4)
			var many []kgo.RecordHeader
			for i := range 1000 {
				many = append(many, kgo.RecordHeader{Key: fmt.Sprintf("h\x00%d\xff", i%7), Value: []byte{byte(i), 0}})
			}
			raw := make([]byte, 7600)
			rand.Read(raw)
			longID := base64.StdEncoding.EncodeToString(raw) // ~10 KB, incompressible
			withID := func(id string, hs ...kgo.RecordHeader) *kgo.Record {
				v, _ := json.Marshal(map[string]any{"event_id": id, "amount": 1})
				return &kgo.Record{Value: v, Headers: append(hs, kgo.RecordHeader{Key: idem.EventIDHeader, Value: []byte(id)})}
			}
			recs := []*kgo.Record{
				/*0*/ {Key: []byte("big"), Value: big},
				/*1*/ withID("hk-ok", kgo.RecordHeader{Key: "\x00key", Value: []byte("v")}, kgo.RecordHeader{Key: "\xff\xfe", Value: nil}),
				/*2*/ {Value: []byte("{"), Headers: many},
				/*3*/ withID("a\x00b"),
				/*4*/ {Value: []byte(`{"event_id":"` + "\xff\xfe" + `","amount":1}`), Headers: []kgo.RecordHeader{{Key: idem.EventIDHeader, Value: []byte("\xff\xfe")}}},
				/*5*/ withID(longID),
				/*6*/ withID("after"),
			}
			for _, r := range recs {
				r.Topic = "bytes"
			}
			if err := outsiderProducer(t, addrs).ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}

			apply := func(ctx context.Context, tx pgx.Tx, ev order) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, amount) VALUES ($1, $2)`, ev.EventID, ev.Amount)
				return err
			}
			field := idem.Consume(idem.EventSpec[order]{Topic: "bytes", Context: "field", EventID: func(o order) string { return o.EventID }}, apply)
			header := idem.Consume(idem.EventSpec[order]{Topic: "bytes", Context: "header"}, apply)
			var out byContext
			startConsumer(t, pool, kafka.ConsumerConfig{
				Brokers: addrs, BatchSize: batch, Handlers: []idem.EventHandler{field, header},
				Retry:    idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond},
				OnRecord: out.record,
			}, nil)
			waitBounded(t, 30*time.Second, "the record after the bad ones, in both contexts", func() bool {
				return out.get("field/bytes/6") == idem.Applied && out.get("header/bytes/6") == idem.Applied
			})
			want := map[string]idem.Outcome{
				"field/bytes/0": idem.DeadLettered, "header/bytes/0": idem.DeadLettered,
				"field/bytes/1": idem.Applied, "header/bytes/1": idem.Applied,
				"field/bytes/2": idem.DeadLettered, "header/bytes/2": idem.DeadLettered,
				"field/bytes/3": idem.DeadLettered, "header/bytes/3": idem.DeadLettered,
				// encoding/json turns invalid UTF-8 into U+FFFD: the field id is
				// storable; the header id is the raw bytes, which text refuses.
				"field/bytes/4": idem.Applied, "header/bytes/4": idem.DeadLettered,
			}
			for k, o := range want {
				if got := out.get(k); got != o {
					t.Errorf("%s: %v, want %v", k, got, o)
				}
			}
			for _, k := range []string{"field/bytes/5", "header/bytes/5"} {
				if o := out.get(k); o != idem.DeadLettered && o != idem.Applied {
					t.Errorf("%s (10 KB id): %v", k, o)
				}
			}
			dls := deadLetters(t, pool)
			found := map[string]*idem.DeadLetter{}
			for _, dl := range dls {
				found[fmt.Sprintf("%s/%d", dl.Context, dl.Record.Offset)] = dl
			}
			for _, ctxName := range []string{"field", "header"} {
				if dl := found[ctxName+"/0"]; dl == nil || !bytes.Equal(dl.Record.Value, big) {
					t.Errorf("%s: the 1 MiB value was not dead-lettered byte for byte", ctxName)
				}
				dl := found[ctxName+"/2"]
				if dl == nil || len(dl.Record.Headers) != 1000 {
					t.Fatalf("%s: 1000 headers not kept: %v", ctxName, dl)
				}
				for i, h := range many {
					if dl.Record.Headers[i].Key != h.Key || !bytes.Equal(dl.Record.Headers[i].Value, h.Value) {
						t.Fatalf("%s header %d: %q=%q, want %q=%q", ctxName, i, dl.Record.Headers[i].Key, dl.Record.Headers[i].Value, h.Key, h.Value)
					}
				}
			}
			// Invalid UTF-8 can never be stored: dead-lettered on the first attempt.
			if dl := found["header/4"]; dl == nil || !strings.Contains(dl.LastError, "22021") || dl.Attempts != 1 {
				t.Errorf("header/4: %+v", dl)
			}
			if n := count(t, pool, `SELECT count(*) FROM effects WHERE event_id = 'after'`); n != 2 {
				t.Errorf("%d effects of the last record, want one per context", n)
			}
		})
	}
}

// A fault while handling a fault: the database goes down at the moment a
// poison record is being dead-lettered. The dead letter must be stored once
// the database returns — not dropped, not stored twice — and the record's
// offset committed only after it.
func TestDeadLetterWriteDuringDBOutage(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	direct, proxied, px := faultDB(t)
	produceOrders(t, addrs, 1, 10, "dlo") // dlo-4 is the poison one
	var calls atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "dlo-4" {
			if calls.Add(1) == 2 {
				px.Down() // the last attempt fails, and so does the dead-letter write
			}
			return errors.New("poison")
		}
		return applyOrder(ctx, tx, ev)
	}
	logs := &capture{}
	cfg := faultConfig(addrs, orderConsumer("orders", handler))
	cfg.Retry = idem.RetryPolicy{MaxAttempts: 2, Initial: time.Millisecond, Max: 2 * time.Millisecond}
	cfg.CommitInterval = 100 * time.Millisecond
	cfg.Logger = slog.New(logs)
	r := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 20*time.Second, "the dead-letter write to fail", func() bool {
		return logs.has("storing dead letter failed", "offset=4")
	})
	time.Sleep(time.Second) // several commit intervals while the dead letter waits
	if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got > 4 {
		t.Fatalf("committed offset %d while the poison record at 4 is not stored", got)
	}
	if d := count(t, direct, `SELECT count(*) FROM idem_dead_letters`); d != 0 {
		t.Fatalf("%d dead letters while the database is down", d)
	}
	px.Restore()
	waitBounded(t, 20*time.Second, "every record done", func() bool {
		return count(t, direct, `SELECT count(*) FROM effects`) == 9 && count(t, direct, `SELECT count(*) FROM idem_dead_letters`) == 1
	})
	r.shutdown(t)
	if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 10 {
		t.Fatalf("committed offset %d, want 10", got)
	}
	if n := count(t, direct, `SELECT count(*) FROM idem_dead_letters WHERE koffset = 4 AND attempts = 2`); n != 1 {
		t.Fatalf("the poison record's dead letter: %d rows", n)
	}
	if calls.Load() != 2 {
		t.Fatalf("poison handler ran %d times, want 2 (waiting for the database is not an attempt)", calls.Load())
	}
}

// The COMMIT of a record reaches PostgreSQL but its answer comes too late:
// the processor gives up on it (StorageTimeout), not knowing whether it
// committed — it did. After recovery the record is a duplicate: one effect,
// no loss, no dead letter, committed offset at the end.
func TestCommitAnswerLostNoDuplicateEffect(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	direct, proxied, px := faultDB(t)
	produceOrders(t, addrs, 1, 6, "cl")
	var slowed atomic.Bool
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if err := applyOrder(ctx, tx, ev); err != nil {
			return err
		}
		if ev.EventID == "cl-2" && slowed.CompareAndSwap(false, true) {
			// The COMMIT that follows takes 2 s to cross, each way.
			px.Latency(2 * time.Second)
			time.AfterFunc(800*time.Millisecond, px.Restore)
		}
		return nil
	}
	var out outcomes
	cfg := faultConfig(addrs, orderConsumer("orders", handler))
	cfg.OnRecord = out.record
	r := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 30*time.Second, "every record done", func() bool { return out.total() == 6 })
	r.shutdown(t)
	if e, de := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(DISTINCT event_id) FROM effects`); e != 6 || de != 6 {
		t.Fatalf("%d effects, %d distinct; want 6 once each", e, de)
	}
	if d := count(t, direct, `SELECT count(*) FROM idem_dead_letters`); d != 0 {
		t.Fatalf("%d dead letters", d)
	}
	if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 6 {
		t.Fatalf("committed offset %d, want 6", got)
	}
	t.Logf("outcomes %v (cl-2 is applied if its COMMIT answer came within StorageTimeout, else a duplicate)", out.n)
}

// Batch mode, a poison record in the middle of a batch and the database cut
// while the batch's transaction is open: the valid records are applied once,
// only the poison one is dead-lettered, offsets end at the end.
func TestBatchPoisonAndDBCut(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	direct, proxied, px := faultDB(t)
	var recs []*kgo.Record
	for i := range 20 {
		r := orderRecord("orders", order{EventID: fmt.Sprintf("bp-%d", i), Amount: int64(i)})
		if i == 7 {
			r.Value = []byte("{\x00 poison")
		}
		recs = append(recs, r)
	}
	if err := outsiderProducer(t, addrs).ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var cut atomic.Bool
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "bp-12" && cut.CompareAndSwap(false, true) {
			px.Cut()
		}
		return applyOrder(ctx, tx, ev)
	}
	var out outcomes
	cfg := faultConfig(addrs, orderConsumer("orders", handler))
	cfg.BatchSize, cfg.MaxPollRecords = 10, 20
	cfg.OnRecord = out.record
	r := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 30*time.Second, "every record done", func() bool { return out.total() >= 20 })
	r.shutdown(t)
	if e, de := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(DISTINCT event_id) FROM effects`); e != 19 || de != 19 {
		t.Fatalf("%d effects, %d distinct; want 19 once each", e, de)
	}
	if d := count(t, direct, `SELECT count(*) FROM idem_dead_letters WHERE koffset = 7`); d != 1 || count(t, direct, `SELECT count(*) FROM idem_dead_letters`) != 1 {
		t.Fatalf("dead letters: want only the poison record")
	}
	if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 20 {
		t.Fatalf("committed offset %d, want 20", got)
	}
}

// NewConsumer validates the config; a CommitInterval kgo refuses used to pass
// it and make Run fail later ("autocommit interval 50ms is less than allowed
// 100ms"), after the deployment had started.
func TestNewConsumerRefusesCommitIntervalKgoRefuses(t *testing.T) {
	t.Parallel()
	store := idem.NewStore(db(t))
	h := orderConsumer("orders", applyOrder)
	base := kafka.ConsumerConfig{Brokers: []string{"127.0.0.1:1"}, Group: "g", Handlers: []idem.EventHandler{h}}
	cfg := base
	cfg.CommitInterval = 50 * time.Millisecond
	if _, err := kafka.NewConsumer(store, cfg); err == nil {
		t.Fatal("NewConsumer accepted CommitInterval 50ms, which Run cannot use")
	}
	cfg.CommitInterval = 100 * time.Millisecond
	if _, err := kafka.NewConsumer(store, cfg); err != nil {
		t.Fatalf("CommitInterval 100ms: %v", err)
	}
}

// The database blackholed while the consumer is idle, then records arrive:
// BEGIN on the pool's open connections gets no answer and times out
// (StorageTimeout) again and again, for longer than the whole budget. No
// valid record may be dead-lettered. (TestDBFaultsDuringConsume's cut and
// blackhole modes fault a connection the handler holds, which surfaces as
// the handler's closed connection; this one makes the processor's own
// statements time out.)
func TestDBBlackholeBeforeRecordsArrive(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	direct, proxied, px := faultDB(t)
	produceOrders(t, addrs, 1, 3, "bh-warm")
	var out outcomes
	cfg := faultConfig(addrs, orderConsumer("orders", applyOrder))
	cfg.OnRecord = out.record
	r := startConsumerOn(t, proxied, cfg)
	waitBounded(t, 20*time.Second, "warm-up records", func() bool { return out.total() == 3 })
	px.Blackhole()
	produceOrders(t, addrs, 1, 5, "bh")
	time.Sleep(2 * time.Second) // 4× StorageTimeout, budget of 1 attempt
	if e := count(t, direct, `SELECT count(*) FROM effects`); e != 3 {
		t.Fatalf("%d effects during the blackhole, want 3", e)
	}
	px.Restore()
	waitBounded(t, 30*time.Second, "every record after the blackhole", func() bool { return out.total() == 8 })
	r.shutdown(t)
	if e, d := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(*) FROM idem_dead_letters`); e != 8 || d != 0 {
		t.Fatalf("%d effects (want 8), %d dead letters (want 0)", e, d)
	}
	if got := committedOffsets(t, addrs, "g", "orders", 1)[0]; got != 8 {
		t.Fatalf("committed offset %d, want 8", got)
	}
}

// Two members of one group, one of them cut from PostgreSQL (blackhole). The
// cut member keeps its partitions (its Kafka session is healthy) and waits;
// the other goes on with its own. After recovery every event is applied
// once, nothing is dead-lettered, committed offsets are the ends.
func TestTwoMembersOneBlackholed(t *testing.T) {
	t.Parallel()
	const partitions = 4
	addrs := cluster(t, partitions, "orders")
	direct, proxied, px := faultDB(t)
	produceOrders(t, addrs, partitions, 40, "tm-a")
	var a, b outcomes
	logsA, logsB := &capture{}, &capture{}
	cfg := faultConfig(addrs, orderConsumer("orders", applyOrder))
	cfg.OnRecord, cfg.Logger = a.record, slog.New(logsA)
	ra := startConsumerOn(t, proxied, cfg)
	cfg.OnRecord, cfg.Logger = b.record, slog.New(logsB)
	rb := startConsumerOn(t, direct, cfg)
	waitBounded(t, 30*time.Second, "the first 40 applied", func() bool { return count(t, direct, `SELECT count(*) FROM effects`) == 40 })
	waitBounded(t, 30*time.Second, "both members assigned", func() bool {
		return logsA.has("partitions assigned", "orders") && logsB.has("partitions assigned", "orders")
	})
	px.Blackhole()
	bBefore := b.total()
	produceOrders(t, addrs, partitions, 40, "tm-b")
	time.Sleep(3 * time.Second)
	during := count(t, direct, `SELECT count(*) FROM effects WHERE event_id LIKE 'tm-b-%'`)
	t.Logf("during A's blackhole: %d of 40 new events applied (B: %d new outcomes)", during, b.total()-bBefore)
	px.Restore()
	waitBounded(t, 30*time.Second, "all 80 applied", func() bool { return count(t, direct, `SELECT count(*) FROM effects`) >= 80 })
	ra.shutdown(t)
	rb.shutdown(t)
	if e, de, d := count(t, direct, `SELECT count(*) FROM effects`), count(t, direct, `SELECT count(DISTINCT event_id) FROM effects`),
		count(t, direct, `SELECT count(*) FROM idem_dead_letters`); e != 80 || de != 80 || d != 0 {
		t.Fatalf("%d effects, %d distinct (want 80 once each), %d dead letters", e, de, d)
	}
	if got, want := committedOffsets(t, addrs, "g", "orders", partitions), endOffsets(t, addrs, "orders", partitions); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("committed offsets %v, want %v", got, want)
	}
}

// A topic deleted and re-created while the consumer runs. kgo refuses to
// consume the new instance (UNKNOWN_TOPIC_ID) until the topic is purged and
// added back; before the fix the consumer polled in a hot loop (≈14,000
// "fetch error" lines a second) and never consumed the new topic. The new
// topic gets more records than the old one had, so a recovery that kept the
// old committed offset (10) would skip its first ten.
func TestTopicRecreatedWhileConsuming(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	addrs := c.ListenAddrs()
	pool := db(t)
	produceOrders(t, addrs, 1, 10, "old")
	var out outcomes
	logs := &capture{}
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", applyOrder)},
		CommitInterval: 100 * time.Millisecond, Logger: slog.New(logs)}, &out)
	waitBounded(t, 20*time.Second, "the old topic consumed", func() bool { return out.total() == 10 })
	waitBounded(t, 20*time.Second, "the old topic committed", func() bool { return committedOffsets(t, addrs, "g", "orders", 1)[0] == 10 })
	adm := outsiderProducer(t, addrs)
	kmsgDeleteTopic(t, adm, "orders")
	kmsgCreateTopic(t, adm, "orders", 1)
	produceOrders(t, addrs, 1, 15, "new")
	waitBounded(t, 60*time.Second, "the re-created topic's records", func() bool {
		return count(t, pool, `SELECT count(*) FROM effects WHERE event_id LIKE 'new-%'`) == 15
	})
	waitBounded(t, 20*time.Second, "the new topic committed", func() bool { return committedOffsets(t, addrs, "g", "orders", 1)[0] == 15 })
	r.shutdown(t)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	fetchErrors := 0
	for _, l := range logs.lines {
		if strings.HasPrefix(l, "fetch error") {
			fetchErrors++
		}
	}
	if fetchErrors > 20 {
		t.Fatalf("%d fetch error lines: the poll loop spins", fetchErrors)
	}
}

func kmsgDeleteTopic(t *testing.T, cl *kgo.Client, topic string) {
	t.Helper()
	req := kmsg.NewPtrDeleteTopicsRequest()
	rt := kmsg.NewDeleteTopicsRequestTopic()
	rt.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, rt)
	req.TopicNames = []string{topic}
	req.TimeoutMillis = 5000
	resp, err := req.RequestWith(context.Background(), cl)
	if err != nil {
		t.Fatal(err)
	}
	for _, tr := range resp.Topics {
		if err := kerr.ErrorForCode(tr.ErrorCode); err != nil {
			t.Fatalf("delete topic: %v", err)
		}
	}
}

func kmsgCreateTopic(t *testing.T, cl *kgo.Client, topic string, partitions int32) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		req := kmsg.NewPtrCreateTopicsRequest()
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic, rt.NumPartitions, rt.ReplicationFactor = topic, partitions, 1
		req.Topics = append(req.Topics, rt)
		req.TimeoutMillis = 5000
		resp, err := req.RequestWith(context.Background(), cl)
		if err != nil {
			t.Fatal(err)
		}
		err = kerr.ErrorForCode(resp.Topics[0].ErrorCode)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("create topic: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A handler that ends its goroutine with runtime.Goexit (t.FailNow in a
// test handler, a library calling it): not a panic, so recover sees
// nothing. The record must not be skipped, nor the records after it, and
// the consumer must go on.
func TestHandlerGoexitLosesNothing(t *testing.T) {
	t.Parallel()
	addrs := cluster(t, 1, "orders")
	pool := db(t)
	produceOrders(t, addrs, 1, 5, "gx")
	var exits atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "gx-1" && exits.Add(1) == 1 {
			runtime.Goexit()
		}
		return applyOrder(ctx, tx, ev)
	}
	var out outcomes
	r := startConsumer(t, pool, kafka.ConsumerConfig{Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", handler)},
		Retry: idem.RetryPolicy{MaxAttempts: 3, Initial: time.Millisecond, Max: 2 * time.Millisecond}}, &out)
	waitBounded(t, 20*time.Second, "the handler's Goexit", func() bool { return exits.Load() >= 1 })
	produceOrders(t, addrs, 1, 5, "gx-later")
	waitBounded(t, 20*time.Second, "the later records", func() bool {
		return count(t, pool, `SELECT count(*) FROM effects WHERE event_id LIKE 'gx-later-%'`) == 5
	})
	r.shutdown(t)
	if e := count(t, pool, `SELECT count(*) FROM effects`); e != 10 {
		var ids []string
		rows, _ := pool.Query(context.Background(), `SELECT event_id FROM effects ORDER BY id`)
		for rows.Next() {
			var s string
			_ = rows.Scan(&s)
			ids = append(ids, s)
		}
		t.Fatalf("%d effects, want 10 (Goexit in a handler lost records): %v; outcomes %v", e, ids, out.n)
	}
}

// A handler blocked in its own SQL (a lock wait, a long query) that respects
// its context holds up only its partition: a member joining the group gets
// its partition at once (the rebalance does not wait for the blocked
// record), the other partition's records are all applied while the handler
// is still blocked, and shutting the blocked member down is prompt: the
// record rolls back, and the other member applies it and the rest once.
// (Under cooperative rebalancing the blocked partition may stay with A; it
// is not interrupted then: a rebalance touches only what it moves.)
func TestBlockedHandlerYieldsToRebalance(t *testing.T) {
	t.Parallel()
	const partitions, n = 2, 20
	addrs := cluster(t, partitions, "orders")
	pool := db(t)
	produceOrders(t, addrs, partitions, n, "blk")
	var blocked atomic.Bool
	entered := make(chan struct{})
	handler := func(ctx context.Context, tx pgx.Tx, ev order) error {
		if ev.EventID == "blk-0" && blocked.CompareAndSwap(false, true) {
			close(entered)
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(3600)`); err != nil {
				return err
			}
		}
		return applyOrder(ctx, tx, ev)
	}
	logsB := &capture{}
	cfg := kafka.ConsumerConfig{Brokers: addrs, Handlers: []idem.EventHandler{orderConsumer("orders", handler)}, MaxPollRecords: 5}
	ra := startConsumer(t, pool, cfg, nil)
	<-entered
	cfg.Logger = slog.New(logsB)
	rb := startConsumer(t, pool, cfg, nil)
	waitBounded(t, 30*time.Second, "member B assigned a partition while A's handler is blocked", func() bool {
		return logsB.has("partitions assigned", "orders:[")
	})
	// Partition 1 holds the odd events: all applied, by A or B, whoever
	// owns partition 0 meanwhile.
	waitBounded(t, 30*time.Second, "partition 1's events", func() bool {
		return count(t, pool, `SELECT count(*) FROM effects WHERE right(event_id, 1) IN ('1','3','5','7','9')`) >= n/2
	})
	stopped := make(chan struct{})
	go func() { ra.shutdown(t); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(15 * time.Second):
		t.Fatal("shutdown of the blocked member not prompt")
	}
	waitBounded(t, 30*time.Second, "every event", func() bool { return count(t, pool, `SELECT count(*) FROM effects`) >= n })
	rb.shutdown(t)
	if e, de := count(t, pool, `SELECT count(*) FROM effects`), count(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); e != n || de != n {
		t.Fatalf("%d effects, %d distinct; want %d once each", e, de, n)
	}
}
