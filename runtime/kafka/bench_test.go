package kafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemgen/idemgen/internal/benchkit"
	"github.com/idemgen/idemgen/internal/benchkit/bareconsumer"
	"github.com/idemgen/idemgen/internal/faultproxy"
	"github.com/idemgen/idemgen/internal/pgtest"
	"github.com/idemgen/idemgen/runtime/idem"
	idemdb "github.com/idemgen/idemgen/runtime/internal/db"
	"github.com/idemgen/idemgen/runtime/internal/relayhook"
	"github.com/idemgen/idemgen/runtime/kafka"
)

// BenchmarkConsumerSideBySide consumes the same records, in each round, with
//
//   - bare:       a plain kgo consumer (bareconsumer.Run, shared with
//     internal/rssbench's peak-RSS benchmark) with kafka.Consumer's
//     structure and commit behaviour, and no dedupe: a worker goroutine per partition,
//     living across polls, fed by the poll loop (which hands each poll's
//     records to the partition's worker without waiting and polls again,
//     pausing a partition whose worker is still busy or has records queued,
//     resumed when the worker takes them, as kafka.Consumer does); the
//     worker applies its records in order, each with the same INSERT in its
//     own transaction, and marks each record after its transaction commits;
//     marks auto-committed every second, rebalances blocked during a poll's
//     hand-out, FetchMaxWait 100ms (kafka.Consumer's default);
//   - bare per-poll: the same per record (bareconsumer.RunPerPoll), in the
//     structure kafka.Consumer had before 2026-12-01: a goroutine per partition for each poll, all waited
//     for before the next poll (so each poll waits for its slowest
//     partition), rebalances blocked meanwhile, kgo's default FetchMaxWait;
//     kept as a second row to show what the structure alone is worth and to
//     continue the series measured against it;
//   - per-record: the generated-style consumer (dedupe row + INSERT, one
//     transaction per record);
//   - batch:      the same in batch mode (100 records per transaction, one
//     multi-row dedupe insert; its row is against bare, which has no batch
//     mode);
//
// each in a fresh consumer group starting at the round's first offset, timed
// from its first record applied to its last (the same stop condition for all
// four: neither the group join before nor the offset commit and close after
// is timed). A warm-up round (statement caches, plans, the broker's and the
// runtime's first allocations) is not counted; then each counted round runs
// the four in turn, bare → bare per-poll → per-record → batch in even rounds
// and the reverse in odd ones, so no side always goes first or last. One
// round's ratio is noisy on a shared machine (0.40–1.31 seen with 3,000
// records), so the rows are the median of the rounds' ratios, with their min
// and max. It also reports PostgreSQL CPU per record (the pool's backends,
// summed over the counted rounds) and round trips per record counted on the
// wire. Each side runs under a pprof label
// side=bare|bare-per-poll|per-record|batch, so a -cpuprofile of this
// benchmark splits the client's CPU by side (go tool pprof -tagfocus
// side=bare -top). Run: go run ./cmd/idembench -only consumer (or go test
// ./runtime/kafka -run '^$' -bench ConsumerSideBySide -benchtime 1x)
func BenchmarkConsumerSideBySide(b *testing.B) {
	records := benchkit.Pick(2000, 5000)
	rounds := benchkit.Pick(8, 16)
	addrs := cluster(b, 3, "bench")
	var rt benchkit.RoundTrips
	pool := pgtest.PoolConfig(b, func(c *pgxpool.Config) { c.ConnConfig.DialFunc = rt.Dial })
	if err := idem.Migrate(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	pgtest.Exec(b, pool, `CREATE TABLE effects (id bigserial PRIMARY KEY, event_id text NOT NULL, amount bigint NOT NULL)`)
	if n := benchkit.History(); n > 0 {
		pgtest.Exec(b, pool, fmt.Sprintf(`INSERT INTO idem_processed_events (context, event_id, topic, kpartition, koffset)
			SELECT 'history', 'h-' || i, 'bench', 0, i FROM generate_series(1, %d) i`, n))
		pgtest.Exec(b, pool, `VACUUM ANALYZE idem_processed_events`)
	}
	p := producer(b, addrs)
	// The pool's backends (pgxpool's default MaxConns here: 4), whose CPU
	// time is read around each run.
	pids, err := benchkit.BackendPIDs(context.Background(), pool, int(pool.Config().MaxConns))
	if err != nil {
		b.Fatal(err)
	}
	// One side of the comparison, and what it measured in the counted rounds.
	type side struct {
		name  string
		run   func(ctx context.Context, group string, start map[string]map[int32]kgo.Offset) time.Duration
		times []time.Duration
		trips int64
		cpu   benchkit.CPU
	}
	bare := &side{name: "bare", run: func(ctx context.Context, group string, start map[string]map[int32]kgo.Offset) time.Duration {
		return bareConsume(ctx, b, addrs, pool, group, start, records, false)
	}}
	barePerPoll := &side{name: "bare-per-poll", run: func(ctx context.Context, group string, start map[string]map[int32]kgo.Offset) time.Duration {
		return bareConsume(ctx, b, addrs, pool, group, start, records, true)
	}}
	perRecord := &side{name: "per-record", run: func(ctx context.Context, group string, start map[string]map[int32]kgo.Offset) time.Duration {
		return idemConsume(ctx, b, addrs, pool, group, start, records, 1)
	}}
	batch := &side{name: "batch", run: func(ctx context.Context, group string, start map[string]map[int32]kgo.Offset) time.Duration {
		return idemConsume(ctx, b, addrs, pool, group, start, records, 100)
	}}
	for round := -1; round < rounds; round++ { // round -1: the warm-up
		var recs []*kgo.Record
		for i := 0; i < records; i++ {
			recs = append(recs, orderRecord("bench", order{EventID: fmt.Sprintf("b-%d-%d-%d", b.N, round, i), Amount: 1}))
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
		turn := []*side{bare, barePerPoll, perRecord, batch}
		if round%2 != 0 {
			slices.Reverse(turn)
		}
		for _, s := range turn {
			group := fmt.Sprintf("%s-%d-%d", s.name, b.N, round)
			before, cpuBefore := rt.Count(), benchkit.ReadCPU(pids)
			var d time.Duration
			pprof.Do(context.Background(), pprof.Labels("side", s.name), func(ctx context.Context) { d = s.run(ctx, group, start) })
			if round < 0 {
				continue
			}
			s.times = append(s.times, d)
			s.trips += rt.Count() - before
			used := benchkit.ReadCPU(pids).Sub(cpuBefore)
			s.cpu.Client += used.Client
			s.cpu.Server += used.Server
		}
		// Each side applied each of the round's records once (none has a
		// dedupe that would hide a hand-written loop's double or missed
		// record): every event id has one effect row per side. Not timed.
		prefix := fmt.Sprintf("b-%d-%d-", b.N, round)
		if n := pgtest.Count(b, pool, `SELECT count(*) FROM (SELECT event_id FROM effects WHERE starts_with(event_id, $1)
			GROUP BY event_id HAVING count(*) = $2) x`, prefix, len(turn)); n != int64(records) {
			b.Fatalf("round %d: %d of %d records have one effect per side (%d sides)", round, n, records, len(turn))
		}
	}
	n := float64(records * rounds)
	// ratios returns each round's throughput ratio of s to base (the same
	// records, so base's time over s's), sorted.
	ratios := func(s, base *side) []float64 {
		r := make([]float64, rounds)
		for i := range r {
			r[i] = base.times[i].Seconds() / s.times[i].Seconds()
		}
		slices.Sort(r)
		return r
	}
	rate := func(s *side) float64 {
		ts := make([]float64, rounds)
		for i, d := range s.times {
			ts[i] = float64(records) / d.Seconds()
		}
		slices.Sort(ts)
		return median(ts)
	}
	recRatios, batchRatios := ratios(perRecord, bare), ratios(batch, bare)
	perPollRatios := ratios(perRecord, barePerPoll)
	section := "Consumer" + benchkit.HistoryLabel()
	benchkit.Emit(benchkit.Row{Section: section, Name: "per-record/bare throughput", Unit: "ratio", Target: "≥ 0.8",
		Value: median(recRatios),
		Detail: fmt.Sprintf("bare: per-partition workers across polls, as the consumer; median of %d rounds (min %.2f, max %.2f); median rec/s bare %.0f, bare per-poll %.0f, per-record %.0f, batch %.0f; %d records a round, after a warm-up round, order alternating, 3 partitions",
			rounds, recRatios[0], recRatios[rounds-1], rate(bare), rate(barePerPoll), rate(perRecord), rate(batch), records)})
	benchkit.Emit(benchkit.Row{Section: section, Name: "batch(100)/bare throughput", Unit: "ratio",
		Value: median(batchRatios), Detail: fmt.Sprintf("median of %d rounds (min %.2f, max %.2f)", rounds, batchRatios[0], batchRatios[rounds-1])})
	benchkit.Emit(benchkit.Row{Section: section, Name: "per-record/bare per-poll throughput", Unit: "ratio",
		Value: median(perPollRatios),
		Detail: fmt.Sprintf("bare per-poll: a goroutine per partition for each poll, each poll waiting for its slowest (the consumer's structure before 2026-12-01); median of %d rounds (min %.2f, max %.2f)",
			rounds, perPollRatios[0], perPollRatios[rounds-1])})
	perRec := func(s *side) (client, server float64) {
		return float64(s.cpu.Client.Microseconds()) / n, float64(s.cpu.Server.Microseconds()) / n
	}
	bc, bs := perRec(bare)
	pc, ps := perRec(barePerPoll)
	rc, rs := perRec(perRecord)
	tc, ts := perRec(batch)
	benchkit.Emit(benchkit.Row{Section: section, Name: "per-record/bare PostgreSQL CPU per record", Unit: "ratio",
		Value: rs / bs,
		Detail: fmt.Sprintf("µs of CPU per record, PostgreSQL backends (this process, with the in-process kfake broker): bare %.0f (%.0f), bare per-poll %.0f (%.0f), per-record %.0f (%.0f), batch %.0f (%.0f)",
			bs, bc, ps, pc, rs, rc, ts, tc)})
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "consumer bare, per record", Unit: "round trips", Value: float64(bare.trips) / n,
		Detail: "BEGIN │ INSERT │ COMMIT"})
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "consumer per-record, per record", Unit: "round trips", Value: float64(perRecord.trips) / n, Target: "3",
		Detail: "BEGIN+dedupe INSERT (with the settings) │ INSERT │ COMMIT"})
	benchkit.Emit(benchkit.Row{Section: "Round trips", Name: "consumer batch(100), per record", Unit: "round trips", Value: float64(batch.trips) / n})
	b.ReportMetric(median(recRatios), "per-record/bare")
	b.ReportMetric(median(batchRatios), "batch/bare")
	b.ReportMetric(median(perPollRatios), "per-record/bare-per-poll")
	b.ReportMetric(rate(bare), "bare-rec/s")
	b.ReportMetric(rate(barePerPoll), "bare-per-poll-rec/s")
	b.ReportMetric(rate(perRecord), "per-record-rec/s")
	b.ReportMetric(rate(batch), "batch-rec/s")
}

// median returns the median of sorted xs (the mean of the middle two when
// their number is even).
func median(xs []float64) float64 {
	m := len(xs) / 2
	if len(xs)%2 == 0 {
		return (xs[m-1] + xs[m]) / 2
	}
	return xs[m]
}

// applySpan counts the records applied and times them, from the first to
// the last; done runs once, when the want-th is applied.
type applySpan struct {
	want int
	done func()

	mu          sync.Mutex
	n           int
	first, last time.Time
}

// applied records one more record applied, now.
func (s *applySpan) applied() {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if s.n == 0 {
		s.first = now
	}
	s.last = now
	if s.n++; s.n == s.want {
		s.done()
	}
}

// count is how many records were applied.
func (s *applySpan) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// took is the time from the first record applied to the last.
func (s *applySpan) took() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last.Sub(s.first)
}

// startAt is the client options that start a new group at start, the
// offsets taken before the run's records were produced.
func startAt(start map[string]map[int32]kgo.Offset) []kgo.Opt {
	return []kgo.Opt{kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd()),
		kgo.AdjustFetchOffsetsFn(func(context.Context, map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
			return start, nil
		})}
}

// idemConsume runs a Consumer in its own group, under a context derived
// from parent (whose profiler labels its handler calls carry), until it has
// done want records; it returns the time from the first to the last.
func idemConsume(parent context.Context, b *testing.B, addrs []string, pool *pgxpool.Pool, group string, start map[string]map[int32]kgo.Offset, want, batch int) time.Duration {
	cons := idem.Consume(idem.EventSpec[order]{Topic: "bench", Context: group, EventID: func(o order) string { return o.EventID }}, applyOrder)
	finished := make(chan struct{})
	span := &applySpan{want: want, done: func() { close(finished) }}
	c, err := kafka.NewConsumer(idem.NewStore(pool), kafka.ConsumerConfig{
		Brokers: addrs, Group: group, Handlers: []idem.EventHandler{cons}, BatchSize: batch, MaxPollRecords: 1000,
		OnRecord:   func(*idem.EventHandler, *idem.Record, idem.Outcome) { span.applied() },
		ClientOpts: startAt(start),
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(parent)
	runDone := make(chan struct{})
	go func() { _ = c.Run(ctx); close(runDone) }()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%s: %d of %d records in 5 minutes", group, span.count(), want)
	}
	cancel()
	<-runDone
	return span.took()
}

// bareConsume runs a bare baseline (bareconsumer.Run, or RunPerPoll when
// perPoll is set: see BenchmarkConsumerSideBySide) in its own group,
// starting at start, until it has applied want records: per record
// json.Unmarshal and the same INSERT as the idempotent handler in a
// transaction of its own. MaxPollRecords is 1,000, as the per-record and
// batch consumers' here. It returns the time from the first record applied
// to the last.
func bareConsume(parent context.Context, b *testing.B, addrs []string, pool *pgxpool.Pool, group string, start map[string]map[int32]kgo.Offset, want int, perPoll bool) time.Duration {
	ctx, cancel := context.WithTimeout(parent, 5*time.Minute)
	defer cancel()
	span := &applySpan{want: want, done: cancel} // the stop condition: every record applied
	cfg := bareconsumer.Config{Brokers: addrs, Group: group, Topic: "bench", MaxPollRecords: 1000,
		Opts: startAt(start),
		Apply: func(ctx context.Context, r *kgo.Record) error {
			var ev order
			_ = json.Unmarshal(r.Value, &ev)
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return applyOrder(ctx, tx, ev) }); err != nil {
				return err
			}
			span.applied()
			return nil
		}}
	run := bareconsumer.Run
	if perPoll {
		run = bareconsumer.RunPerPoll
	}
	if err := run(ctx, cfg); err != nil {
		b.Errorf("%s: %v", group, err)
	}
	if n := span.count(); n < want {
		b.Fatalf("%s: %d of %d records", group, n, want)
	}
	return span.took()
}

// BenchmarkRelaySideBySide publishes the same outbox events with
//
//   - relay: the Relay (claim up to 500 rows in one statement, produce them
//     all concurrently, mark them in one statement);
//   - seed:  the seed article's relay_batch, faithfully: in one
//     transaction, claim 50 rows in one statement, then for each row
//     send_and_wait and an UPDATE to PUBLISHED, and commit once per batch;
//
// first against in-process kfake (a produce round trip of microseconds),
// then through a proxy adding 0.5 ms each way (about 1 ms per produce, a
// broker on the same network). Then commit-to-publish latency p50/p99 of
// the Relay with LISTEN/NOTIFY and with polling only (250 ms interval).
// Run: go run ./cmd/idembench -only relay
func BenchmarkRelaySideBySide(b *testing.B) {
	events := benchkit.Pick(2000, 10000)
	rounds := benchkit.Pick(2, 3)
	evs := make([]keyed, events)
	for i := range evs {
		evs[i] = keyed{Key: fmt.Sprintf("k%d", i%50), Seq: i}
	}
	for _, link := range []struct {
		name    string
		latency time.Duration
	}{{"in-process kfake", 0}, {"+1 ms per produce", 500 * time.Microsecond}} {
		c, proxies := faultproxy.KafkaCluster(b, 1, kfake.SeedTopics(3, "events"))
		faultproxy.Each(proxies, func(p *faultproxy.Proxy) { p.PreciseLatency(link.latency) }) // a timer would sleep ≥ 1 ms a chunk
		addrs := c.ListenAddrs()
		pool := db(b)
		if n := benchkit.History(); n > 0 {
			pgtest.Exec(b, pool, fmt.Sprintf(`INSERT INTO idem_outbox (topic, payload, status, published_at)
				SELECT 'events', '\x00'::bytea, 'PUBLISHED', now() FROM generate_series(1, %d)`, n))
			pgtest.Exec(b, pool, `VACUUM ANALYZE idem_outbox`)
		}
		pub := publisher(b, addrs)
		// The produce round trip this link really gives (timer overshoot
		// on a loaded machine makes it more than the proxy's setting).
		var acks []time.Duration
		for i := range 50 {
			t := time.Now()
			if err := pub.Client.ProduceSync(context.Background(), &kgo.Record{Topic: "events", Value: []byte(strconv.Itoa(i))}).FirstErr(); err != nil {
				b.Fatal(err)
			}
			acks = append(acks, time.Since(t))
		}
		var relayT, seedT time.Duration
		for range rounds {
			enqueue(b, pool, "events", evs...)
			start := time.Now()
			stop := startRelay(b, newRelay(b, pool, pub, idem.RelayConfig{PollInterval: 20 * time.Millisecond}))
			for pgtest.Count(b, pool, `SELECT count(*) FROM idem_outbox WHERE status <> 'PUBLISHED'`) > 0 {
				time.Sleep(2 * time.Millisecond)
			}
			relayT += time.Since(start)
			stop()

			enqueue(b, pool, "events", evs...)
			start = time.Now()
			seedRelay(b, pool, pub.Client)
			seedT += time.Since(start)
		}
		n := float64(events * rounds)
		benchkit.Emit(benchkit.Row{Section: "Relay" + benchkit.HistoryLabel(), Name: "relay/seed throughput, " + link.name, Unit: "ratio",
			Value: seedT.Seconds() / relayT.Seconds(),
			Detail: fmt.Sprintf("relay %.0f ev/s, seed %.0f ev/s; %d events × %d rounds; one produce acked in p50 %.2f ms",
				n/relayT.Seconds(), n/seedT.Seconds(), events, rounds, benchkit.Ms(benchkit.Percentile(acks, 0.5)))})
		b.ReportMetric(seedT.Seconds()/relayT.Seconds(), "relay/seed")
	}

	addrs := cluster(b, 3, "events")
	notify := relayLatency(b, addrs, false)
	poll := relayLatency(b, addrs, true)
	benchkit.Emit(benchkit.Row{Section: "Relay", Name: "commit→publish p50, NOTIFY", Unit: "ms", Value: benchkit.Ms(notify[0]),
		Detail: fmt.Sprintf("p99 %.1f ms", benchkit.Ms(notify[1]))})
	benchkit.Emit(benchkit.Row{Section: "Relay", Name: "commit→publish p50, polling 250 ms", Unit: "ms", Value: benchkit.Ms(poll[0]),
		Detail: fmt.Sprintf("p99 %.1f ms", benchkit.Ms(poll[1]))})
}

// seedRelay is the seed article's relay_batch loop on the same queries: in
// one transaction, claim a batch of 50 in one statement, then for each row
// produce and wait for the ack and UPDATE it to PUBLISHED, then commit; until
// a claim finds nothing.
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
		sent := 0
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			qtx := idemdb.New(tx)
			rows, err := qtx.ClaimOutboxBatch(ctx, idemdb.ClaimOutboxBatchParams{Name: "idem_outbox", BatchSize: 50, ClaimToken: token, LeaseSeconds: 60})
			if err != nil {
				return err
			}
			sort.Slice(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
			for _, row := range rows {
				rec := &kgo.Record{Topic: row.Topic, Key: row.RecordKey, Value: row.Payload,
					Headers: []kgo.RecordHeader{{Key: idem.EventIDHeader, Value: []byte(row.EventID)}}}
				if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
					return err
				}
				if _, err := qtx.MarkOutboxPublished(ctx, idemdb.MarkOutboxPublishedParams{Name: "idem_outbox", Ids: []int64{row.ID}, ClaimToken: token}); err != nil {
					return err
				}
			}
			sent = len(rows)
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		if sent == 0 {
			return
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
	relay := newRelay(b, pool, tp, idem.RelayConfig{PollInterval: 250 * time.Millisecond, OnLeader: sync.OnceFunc(func() { close(led) })})
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
