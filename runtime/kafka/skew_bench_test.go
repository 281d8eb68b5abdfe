package kafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// BenchmarkConsumerSkewed consumes a backlog on one partition of two while
// the other is idle, per record and in batches of 100, with the consumer's
// default FetchMaxWait: the case where pausing a partition that is behind
// costs most, because a fetch in flight for the idle partition alone waits
// out FetchMaxWait before the resumed partition is fetched again. It
// reports records a second, from the first record applied to the last, one
// run of each mode (no baseline, no rounds: about 0.2–1.5s each, so a single
// figure moves by 10–20% between runs). Run: go run ./cmd/idembench -only
// consumer-skew (or go test ./runtime/kafka -run '^$' -bench ConsumerSkewed
// -benchtime 1x)
func BenchmarkConsumerSkewed(b *testing.B) {
	b.Run("per-record", func(b *testing.B) { benchSkewed(b, 1) })
	b.Run("batch100", func(b *testing.B) { benchSkewed(b, 100) })
}

func benchSkewed(b *testing.B, batch int) {
	const records = 3000
	addrs := cluster(b, 2, "orders")
	pool := db(b)
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := range records {
		r := orderRecord("orders", order{EventID: fmt.Sprintf("sk-%d", i), Amount: 1})
		r.Partition = 0
		recs = append(recs, r)
	}
	produce(b, cl, recs...)
	finished := make(chan struct{})
	span := &applySpan{want: records, done: func() { close(finished) }}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{Brokers: addrs, Group: "skew", BatchSize: batch,
		Handlers:   []idem.EventHandler{orderConsumer("orders", applyOrder)},
		OnRecord:   func(*idem.EventHandler, *idem.Record, idem.Outcome) { span.applied() },
		ClientOpts: []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { _ = c.Run(ctx); close(runDone) }()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%d of %d records in 5 minutes", span.count(), records)
	}
	cancel()
	<-runDone
	d := span.took()
	b.ReportMetric(records/d.Seconds(), "rec/s")
	mode := "per-record"
	if batch > 1 {
		mode = fmt.Sprintf("batch(%d)", batch)
	}
	benchkit.Emit(benchkit.Row{Section: "Consumer, skewed", Name: mode + ", one busy partition of two", Unit: "rec/s",
		Value:  records / d.Seconds(),
		Detail: fmt.Sprintf("%d records on partition 0, partition 1 idle; one run, first record applied to last; FetchMaxWait 100ms (the consumer's default): the busy partition is paused while its worker is behind, and a resumed partition waits for the idle partition's fetch in flight", records)})
	b.Logf("%d records on one partition in %v: %.0f rec/s; effects %d", records, d, records/d.Seconds(),
		pgtest.Count(b, pool, `SELECT count(*) FROM effects`))
}
