package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/runtime/idem"
	idemdb "github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/relayhook"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// BenchmarkConsumerSideBySide consumes the same records, in each round, with
//
//   - bare:       a kgo poll loop doing the same INSERT in its own
//     transaction per record, with no dedupe, committing offsets after;
//   - per-record: the generated-style consumer (dedupe row + INSERT, one
//     transaction per record);
//   - batch:      the same in batch mode (100 records per transaction, one
//     multi-row dedupe insert);
//
// timing each from its first record to its last, and reports records/s and
// the ratios to bare. Run:
//
//	go test ./runtime/kafka -run '^$' -bench ConsumerSideBySide -benchtime 3x
func BenchmarkConsumerSideBySide(b *testing.B) {
	const records = 3000
	addrs := cluster(b, 3, "bench")
	pool := db(b)
	p := producer(b, addrs)
	var perRecord, batch, bare time.Duration
	for round := 0; round < b.N; round++ {
		var recs []*kgo.Record
		for i := 0; i < records; i++ {
			recs = append(recs, orderRecord("bench", order{EventID: fmt.Sprintf("b-%d-%d", round, i), Amount: 1}))
		}
		produce(b, p, recs...)
		// Every round appends records; each consumer starts at this round's
		// first offset by using a fresh group that skips what came before.
		start := map[string]map[int32]kgo.Offset{"bench": {}}
		for _, r := range recs {
			if _, ok := start["bench"][r.Partition]; !ok {
				start["bench"][r.Partition] = kgo.NewOffset().At(r.Offset)
			}
		}
		bare += bareConsume(b, addrs, pool, fmt.Sprintf("bare-%d", round), start, records)
		perRecord += idemConsume(b, addrs, pool, fmt.Sprintf("rec-%d", round), start, records, 1)
		batch += idemConsume(b, addrs, pool, fmt.Sprintf("batch-%d", round), start, records, 100)
	}
	n := float64(records * b.N)
	b.ReportMetric(n/bare.Seconds(), "bare-rec/s")
	b.ReportMetric(n/perRecord.Seconds(), "per-record-rec/s")
	b.ReportMetric(n/batch.Seconds(), "batch-rec/s")
	b.ReportMetric(bare.Seconds()/perRecord.Seconds(), "per-record/bare")
	b.ReportMetric(bare.Seconds()/batch.Seconds(), "batch/bare")
}

// idemConsume runs a Consumer in its own group and context until it has
// done want records; it returns the time from the first to the last.
func idemConsume(b *testing.B, addrs []string, pool *pgxpool.Pool, group string, start map[string]map[int32]kgo.Offset, want, batch int) time.Duration {
	cons := idem.Consume(idem.EventSpec[order]{Topic: "bench", Context: group, EventID: func(o order) string { return o.EventID }}, applyOrder)
	var mu sync.Mutex
	var first, last time.Time
	done := 0
	finished := make(chan struct{})
	onRecord := func(*idem.EventHandler, *idem.Record, idem.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		now := time.Now()
		if done == 0 {
			first = now
		}
		last = now
		if done++; done == want {
			close(finished)
		}
	}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{
		Brokers: addrs, Group: group, Handlers: []idem.EventHandler{cons}, BatchSize: batch, MaxPollRecords: 1000,
		OnRecord: onRecord,
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd()),
			kgo.AdjustFetchOffsetsFn(func(context.Context, map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
				return start, nil
			})},
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { _ = c.Run(ctx); close(runDone) }()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%s: %d of %d records in 5 minutes", group, done, want)
	}
	cancel()
	<-runDone
	return last.Sub(first)
}

// bareConsume is the baseline: no dedupe, same INSERT, offsets committed
// after the transactions of each poll.
func bareConsume(b *testing.B, addrs []string, pool *pgxpool.Pool, group string, start map[string]map[int32]kgo.Offset, want int) time.Duration {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumerGroup(group), kgo.ConsumeTopics("bench"),
		kgo.DisableAutoCommit(), kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd()),
		kgo.AdjustFetchOffsetsFn(func(context.Context, map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
			return start, nil
		}))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var first time.Time
	done := 0
	for done < want {
		fetches := cl.PollRecords(ctx, 1000)
		if ctx.Err() != nil {
			b.Fatalf("bare: %d of %d records", done, want)
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, r := range p.Records {
					var ev order
					_ = json.Unmarshal(r.Value, &ev)
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return applyOrder(ctx, tx, ev) })
					if err != nil {
						b.Error(err)
						return
					}
					mu.Lock()
					if done == 0 {
						first = time.Now()
					}
					done++
					mu.Unlock()
				}
			}()
		})
		wg.Wait()
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(first)
}

// BenchmarkRelaySideBySide publishes the same number of outbox events with
//
//   - batched: the Relay (claim up to 500 rows in one statement, produce them
//     all concurrently, mark them in one statement);
//   - per-row: the seed article's relay_batch (claim 50 rows, then per row:
//     send_and_wait, mark that row);
//
// and reports events/s and the ratio; then commit-to-publish latency p50 and
// p99 of the Relay with LISTEN/NOTIFY and with polling only (250ms interval).
// Run:
//
//	go test ./runtime/kafka -run '^$' -bench RelaySideBySide -benchtime 3x
func BenchmarkRelaySideBySide(b *testing.B) {
	const events = 2000
	addrs := cluster(b, 3, "events")
	pool := db(b)
	pub := publisher(b, addrs)
	var batched, perRow time.Duration
	evs := make([]keyed, events)
	for i := range evs {
		evs[i] = keyed{Key: fmt.Sprintf("k%d", i%50), Seq: i}
	}
	for round := 0; round < b.N; round++ {
		enqueue(b, pool, "events", evs...)
		start := time.Now()
		stop := startRelay(b, newRelay(b, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
		waitUntil(b, "batched relay", func() bool { return statusCounts(b, pool)["PENDING"] == 0 && statusCounts(b, pool)["PUBLISHING"] == 0 })
		batched += time.Since(start)
		stop()

		enqueue(b, pool, "events", evs...)
		start = time.Now()
		seedRelay(b, pool, pub.Client)
		perRow += time.Since(start)
	}
	n := float64(events * b.N)
	b.ReportMetric(n/batched.Seconds(), "batched-ev/s")
	b.ReportMetric(n/perRow.Seconds(), "per-row-ev/s")
	b.ReportMetric(perRow.Seconds()/batched.Seconds(), "batched/per-row")

	notify := relayLatency(b, addrs, false)
	poll := relayLatency(b, addrs, true)
	b.ReportMetric(float64(notify[0].Microseconds())/1000, "notify-p50-ms")
	b.ReportMetric(float64(notify[1].Microseconds())/1000, "notify-p99-ms")
	b.ReportMetric(float64(poll[0].Microseconds())/1000, "poll-p50-ms")
	b.ReportMetric(float64(poll[1].Microseconds())/1000, "poll-p99-ms")
}

// seedRelay is the article's relay_batch, on the same queries: claim a batch
// of 50, then for each row produce and wait for the ack, and mark that row.
func seedRelay(b *testing.B, pool *pgxpool.Pool, cl *kgo.Client) {
	ctx := context.Background()
	q := idemdb.New(pool)
	token := pgtype.Text{String: "seed", Valid: true}
	// Claims need the lease: take it under the token "seed" (the Relay run
	// before this one released its lease when it stopped).
	if l, err := q.AcquireRelayLease(ctx, idemdb.AcquireRelayLeaseParams{Name: "idem_outbox", Holder: "seed", Token: token.String, LeaseSeconds: 3600}); err != nil || !l.Acquired {
		b.Fatalf("seed relay: lease not acquired (%v)", err)
	}
	defer func() {
		if _, err := q.ReleaseRelayLease(ctx, idemdb.ReleaseRelayLeaseParams{Name: "idem_outbox", Token: token.String}); err != nil {
			b.Fatal(err)
		}
	}()
	for {
		rows, err := q.ClaimOutboxBatch(ctx, idemdb.ClaimOutboxBatchParams{Name: "idem_outbox", BatchSize: 50, ClaimToken: token, LeaseSeconds: 60})
		if err != nil {
			b.Fatal(err)
		}
		if len(rows) == 0 {
			return
		}
		sort.Slice(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
		for _, row := range rows {
			rec := &kgo.Record{Topic: row.Topic, Key: row.RecordKey, Value: row.Payload,
				Headers: []kgo.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(row.EventID)}}}
			if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
				b.Fatal(err)
			}
			if _, err := q.MarkOutboxPublished(ctx, idemdb.MarkOutboxPublishedParams{Name: "idem_outbox", Ids: []int64{row.ID}, ClaimToken: token}); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// timingPublisher records when each event (by seq) was acked.
type timingPublisher struct {
	inner idem.Publisher
	mu    sync.Mutex
	acked map[int]time.Time
}

func (p *timingPublisher) Publish(ctx context.Context, msgs []idem.Message) []error {
	errs := p.inner.Publish(ctx, msgs)
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range msgs {
		var ev keyed
		if errs[i] == nil && json.Unmarshal(m.Value, &ev) == nil {
			p.acked[ev.Seq] = now
		}
	}
	return errs
}

// relayLatency commits 200 single-event transactions a few milliseconds
// apart and returns the p50 and p99 of commit → broker ack.
func relayLatency(b *testing.B, addrs []string, pollOnly bool) [2]time.Duration {
	pool := db(b)
	tp := &timingPublisher{inner: publisher(b, addrs), acked: map[int]time.Time{}}
	led := make(chan struct{})
	relay := newRelay(b, pool, tp, idem.RelayConfig{PollInterval: 250 * time.Millisecond, OnLeader: func() { close(led) }})
	if pollOnly {
		relayhook.DisableNotify(relay)
	}
	stop := startRelay(b, relay)
	defer stop()
	select {
	case <-led: // leading: the takeover reset is done, the first claim comes next
	case <-time.After(60 * time.Second):
		b.Fatal("the relay did not become the leader in 60s")
	}
	const n = 200
	committed := make([]time.Time, n)
	for i := 0; i < n; i++ {
		enqueue(b, pool, "events", keyed{Key: "lat", Seq: i})
		committed[i] = time.Now()
		time.Sleep(time.Duration(2+i%7) * time.Millisecond)
	}
	waitUntil(b, "every event acked", func() bool { tp.mu.Lock(); defer tp.mu.Unlock(); return len(tp.acked) == n })
	lat := make([]time.Duration, n)
	tp.mu.Lock()
	for i := range lat {
		lat[i] = tp.acked[i].Sub(committed[i])
	}
	tp.mu.Unlock()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return [2]time.Duration{lat[n/2], lat[n*99/100]}
}
