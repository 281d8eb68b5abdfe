// Package kafka runs idemgen's consumers and outbox relay on Kafka with
// franz-go (kgo). The idem package holds the broker-agnostic logic; this
// package adapts it: it polls records, hands them to an idem.Processor, and
// commits a record's offset only after its database transaction committed.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemgen/idemgen/internal/crash"
	"github.com/idemgen/idemgen/runtime/idem"
	"github.com/idemgen/idemgen/runtime/internal/guardlane"
)

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	// Brokers are the seed brokers, e.g. []string{"127.0.0.1:9092"}.
	Brokers []string
	// Group is the consumer group.
	Group string
	// Handlers are the generated handlers (e.g. the package's
	// IdemConsumers(...)); their topics are consumed. Several handlers may
	// share a topic if their contexts differ; each applies each record in its
	// own context.
	Handlers []idem.EventHandler
	// BatchSize > 1 enables batch mode: up to BatchSize records of one
	// partition are applied in one transaction with one multi-row dedupe
	// insert. Default 1: one transaction per record.
	BatchSize int
	// Retry is the budget of a record's own failures (handler error, panic)
	// before it is dead-lettered.
	Retry idem.RetryPolicy
	// Outage is the wait between tries while PostgreSQL is unavailable;
	// such failures use no retry budget (see idem.ProcessorConfig).
	Outage idem.Backoff
	// StorageTimeout bounds each of the processor's own statements (see
	// idem.ProcessorConfig). Default 10s.
	StorageTimeout time.Duration
	// IdleInTransactionTimeout bounds how long a member frozen mid-record
	// keeps its locks (see idem.ProcessorConfig). Default 2m.
	IdleInTransactionTimeout time.Duration
	// CommitInterval is how often marked offsets are committed (default 1s,
	// at least 100ms, kgo's minimum).
	// Offsets are also committed on partition revocation and on shutdown.
	CommitInterval time.Duration
	// MaxPollRecords bounds the records handled per poll (default 500).
	MaxPollRecords int
	// OnRecord, if set, is called after each record is done (applied, a
	// duplicate, or dead-lettered), once per handler, before its offset is
	// marked. Use it for metrics or logging; it runs on the partition's
	// goroutine, so keep it fast. A runtime.Goexit in it (t.FailNow in a
	// test) ends that goroutine: the partition's records not yet marked
	// are fetched again (duplicates of those applied), and an error is
	// logged; a panic in it ends the process.
	OnRecord func(h *idem.EventHandler, rec *idem.Record, o idem.Outcome)
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// MeterProvider and TracerProvider receive the processor's metrics and
	// spans (see idem.ProcessorConfig); nil: the global providers.
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	// ClientOpts are extra kgo options (TLS, SASL, ConsumeResetOffset, ...).
	// The options the delivery guarantee rests on are always set by Run and
	// must not be overridden: ConsumerGroup, ConsumeTopics, AutoCommitMarks,
	// BlockRebalanceOnPoll, OnPartitionsAssigned, OnPartitionsRevoked,
	// OnPartitionsLost, OnPartitionsCallbackBlocked.
	ClientOpts []kgo.Opt
}

// Consumer consumes the topics of a set of generated handlers with
// exactly-once effects on PostgreSQL.
//
// Per record: in one transaction, the processed-event row and the handler's
// writes commit (or a duplicate is skipped); only then is the record's offset
// marked, and marked offsets are committed per partition, in order, every
// CommitInterval, on revocation and on shutdown. Rebalances are blocked while
// a poll is being processed, so no commit crosses a rebalance; a rebalance
// that is waiting interrupts the poll (see Run). Partitions of one poll are
// processed concurrently, records within a partition in order.
type Consumer struct {
	cfg     ConsumerConfig
	proc    *idem.Processor
	byTopic map[string][]*idem.EventHandler
	topics  []string
	logger  *slog.Logger
	started atomic.Bool
}

// NewConsumer validates cfg and returns a Consumer on store; it keeps a copy
// of cfg. It opens nothing: Run opens the Kafka client and closes it when it
// returns, so a Consumer that is never run holds no resources.
func NewConsumer(store *idem.Store, cfg ConsumerConfig) (*Consumer, error) {
	if cfg.Group == "" || len(cfg.Brokers) == 0 || len(cfg.Handlers) == 0 {
		return nil, errors.New("kafka consumer: Brokers, Group and Handlers are required")
	}
	if cfg.BatchSize < 0 || cfg.MaxPollRecords < 0 || cfg.CommitInterval < 0 {
		return nil, errors.New("kafka consumer: BatchSize, MaxPollRecords and CommitInterval must not be negative")
	}
	// kgo refuses an autocommit interval below 100ms, but only when Run
	// opens the client; refuse it here, where the config is validated.
	if cfg.CommitInterval > 0 && cfg.CommitInterval < minCommitInterval {
		return nil, fmt.Errorf("kafka consumer: CommitInterval %v is below the minimum %v", cfg.CommitInterval, minCommitInterval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	proc, err := idem.NewProcessor(store, idem.ProcessorConfig{
		Retry: cfg.Retry, Outage: cfg.Outage, StorageTimeout: cfg.StorageTimeout, Logger: cfg.Logger,
		MeterProvider: cfg.MeterProvider, TracerProvider: cfg.TracerProvider,
		IdleInTransactionTimeout: cfg.IdleInTransactionTimeout,
	})
	if err != nil {
		return nil, fmt.Errorf("kafka consumer: %w", err)
	}
	cfg.Handlers = append([]idem.EventHandler(nil), cfg.Handlers...)
	cfg.Brokers = append([]string(nil), cfg.Brokers...)
	cfg.ClientOpts = append([]kgo.Opt(nil), cfg.ClientOpts...)
	cfg.BatchSize = max(cfg.BatchSize, 1)
	if cfg.MaxPollRecords == 0 {
		cfg.MaxPollRecords = 500
	}
	if cfg.CommitInterval == 0 {
		cfg.CommitInterval = time.Second
	}
	c := &Consumer{cfg: cfg, proc: proc, byTopic: map[string][]*idem.EventHandler{}, logger: cfg.Logger}
	seen := map[[2]string]bool{}
	for i := range c.cfg.Handlers {
		h := &c.cfg.Handlers[i]
		if h.Topic == "" || h.Context == "" {
			return nil, fmt.Errorf("kafka consumer: handler %d has no Topic or Context", i)
		}
		// Two handlers with one context on one topic would each see the
		// other's processed-event rows and skip half the events.
		if seen[[2]string{h.Topic, h.Context}] {
			return nil, fmt.Errorf("kafka consumer: two handlers of topic %q share context %q", h.Topic, h.Context)
		}
		seen[[2]string{h.Topic, h.Context}] = true
		if _, ok := c.byTopic[h.Topic]; !ok {
			c.topics = append(c.topics, h.Topic)
		}
		c.byTopic[h.Topic] = append(c.byTopic[h.Topic], h)
	}
	return c, nil
}

// minCommitInterval is kgo's lower bound on AutoCommitInterval.
const minCommitInterval = 100 * time.Millisecond

// errRebalancePending is the cause of a poll's context cancelled because a
// rebalance is waiting for it.
var errRebalancePending = errors.New("a rebalance is waiting for this poll")

// run is the state of one Run: the client and the poll being processed.
type run struct {
	*Consumer
	client *kgo.Client

	mu      sync.Mutex
	hurry   context.CancelCauseFunc // cancels the poll being processed
	pending bool                    // a rebalance signalled it is waiting

	// Fetch failures, touched by Run's goroutine only.
	fetchFailures  int                  // polls in a row that failed and returned nothing
	unknownIDSince map[string]time.Time // topics answering UNKNOWN_TOPIC_ID, since when
}

// Run consumes until ctx is cancelled, then finishes or rolls back the
// records in hand, commits the offsets of committed transactions, leaves the
// group and closes the client. It returns nil after a clean shutdown. A
// Consumer runs once.
//
// While a poll is processed, rebalances wait (BlockRebalanceOnPoll): this is
// what makes every offset committed on revoke belong to a committed
// transaction. A poll can take long — a handler retrying with backoff, or
// the database down and the processor waiting it out — and a rebalance held
// past the group's rebalance timeout gets this member kicked out, so a
// waiting rebalance (OnPartitionsCallbackBlocked) cancels the poll's context:
// the record in hand rolls back, nothing after it is marked, and each
// partition's fetch position is moved back to its first record not done
// (SetOffsets, before AllowRebalance, while the partition is still ours).
// If the partition stays with this member it is fetched again from there;
// if it moves, the new owner starts at the last committed offset. Either way
// nothing is skipped and nothing uncommitted is marked.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("kafka consumer: Run called twice")
	}
	r := &run{Consumer: c, unknownIDSince: map[string]time.Time{}}
	opts := append([]kgo.Opt{}, c.cfg.ClientOpts...)
	opts = append(opts,
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.topics...),
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(c.cfg.CommitInterval),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(r.onAssigned),
		kgo.OnPartitionsRevoked(r.onRevoked),
		kgo.OnPartitionsLost(r.onLost),
		kgo.OnPartitionsCallbackBlocked(r.onBlocked),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kafka consumer: %w", err)
	}
	r.client = cl
	defer r.close()
	for {
		fetches := cl.PollRecords(ctx, c.cfg.MaxPollRecords)
		if fetches.IsClientClosed() || ctx.Err() != nil {
			cl.AllowRebalance()
			return nil
		}
		failing := r.fetchErrors(fetches)
		pollCtx, cancel := context.WithCancelCause(ctx)
		r.arm(cancel)
		var (
			wg     sync.WaitGroup
			mu     sync.Mutex
			rewind = map[string]map[int32]kgo.EpochOffset{}
		)
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) == 0 {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				rewindTo := func(rec *kgo.Record) {
					mu.Lock()
					defer mu.Unlock()
					if rewind[rec.Topic] == nil {
						rewind[rec.Topic] = map[int32]kgo.EpochOffset{}
					}
					rewind[rec.Topic][rec.Partition] = kgo.EpochOffset{Epoch: rec.LeaderEpoch, Offset: rec.Offset}
				}
				// pending is the first record not marked; returned is
				// false while this goroutine unwinds from a
				// runtime.Goexit in code the application gave the loop
				// (OnRecord): then the records not marked are fetched
				// again, as for an interrupted poll. Without it the next
				// poll went on after them, and its marks committed past
				// them: records lost.
				pending, returned := p.Records[0], false
				defer func() {
					if !returned && pending != nil {
						c.logger.Error("the partition loop's goroutine ended (runtime.Goexit in OnRecord); its records not done will be fetched again",
							"group", c.cfg.Group, "topic", pending.Topic, "partition", pending.Partition, "offset", pending.Offset)
						rewindTo(pending)
					}
				}()
				// One worker goroutine for the handler calls of this
				// partition's records (see guardlane), ended with them.
				lane, stop := guardlane.With(pollCtx)
				defer stop()
				if rec := r.processPartition(lane, p.Records, &pending); rec != nil {
					rewindTo(rec)
				}
				returned = true
			}()
		})
		wg.Wait()
		cause := context.Cause(pollCtx)
		r.disarm()
		cancel(nil)
		if ctx.Err() != nil {
			cl.AllowRebalance()
			return nil
		}
		if len(rewind) > 0 {
			c.logger.Info("poll interrupted; records not done will be fetched again", "group", c.cfg.Group,
				"cause", cause, "from", fmt.Sprint(rewind))
			cl.SetOffsets(rewind)
		}
		cl.AllowRebalance()
		if err := r.backOffFetchErrors(ctx, failing, fetches.NumRecords() > 0); err != nil {
			return nil
		}
	}
}

// recreateGrace is how long a consumed topic must answer UNKNOWN_TOPIC_ID
// before it is taken as deleted and re-created (and not a broker whose
// metadata lags for a moment).
const recreateGrace = 2 * time.Second

// fetchErrors logs a poll's fetch errors and returns whether there were any.
// It tracks since when each topic answers UNKNOWN_TOPIC_ID.
func (r *run) fetchErrors(fetches kgo.Fetches) bool {
	failing := false
	unknownID := map[string]bool{}
	fetches.EachError(func(topic string, p int32, err error) {
		if errors.Is(err, context.Canceled) {
			return
		}
		failing = true
		if errors.Is(err, kerr.UnknownTopicID) {
			unknownID[topic] = true
		}
		if r.fetchFailures == 0 { // the first of a run of failures; the others are counted in backOffFetchErrors
			r.logger.Warn("fetch error", "group", r.cfg.Group, "topic", topic, "partition", p, "err", err)
		}
	})
	for topic := range r.unknownIDSince {
		if !unknownID[topic] {
			delete(r.unknownIDSince, topic)
		}
	}
	for topic := range unknownID {
		if _, ok := r.unknownIDSince[topic]; !ok {
			r.unknownIDSince[topic] = time.Now()
		}
	}
	return failing
}

// backOffFetchErrors waits before the next poll while fetches fail and
// return nothing: kgo returns a failing fetch at once, so without a wait the
// poll loop spins (seen: 14,000 "fetch error" lines a second after a topic
// was re-created). It also recovers from a topic deleted and re-created
// while consumed: kgo refuses to consume the new instance (UNKNOWN_TOPIC_ID)
// until the topic is purged from the client and added back (kgo README,
// "Topic recreation"). It returns ctx's error when ctx ends during the wait.
func (r *run) backOffFetchErrors(ctx context.Context, failing, gotRecords bool) error {
	if !failing || gotRecords {
		if r.fetchFailures > 1 {
			r.logger.Info("fetching again after failures", "group", r.cfg.Group, "failed_polls", r.fetchFailures)
		}
		r.fetchFailures = 0
		return nil
	}
	r.fetchFailures++
	for topic, since := range r.unknownIDSince {
		if time.Since(since) < recreateGrace {
			continue
		}
		delete(r.unknownIDSince, topic)
		r.recoverRecreatedTopic(topic)
	}
	wait := fetchBackoff(r.fetchFailures)
	if r.fetchFailures%10 == 0 {
		r.logger.Warn("fetches still failing; waiting between polls", "group", r.cfg.Group,
			"failed_polls", r.fetchFailures, "wait", wait)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fetchBackoff is the wait after n failed polls in a row: 50ms doubling to
// 2s, between half and all of it.
func fetchBackoff(n int) time.Duration {
	d := 50 * time.Millisecond << min(max(n-1, 0), 6)
	d = min(d, 2*time.Second)
	return d/2 + rand.N(d/2+1)
}

// recoverRecreatedTopic purges topic from the client and consumes it
// again. The broker deleted the group's committed offsets of the old
// instance with it, so the new instance starts at the group's reset offset
// (ClientOpts' ConsumeResetOffset).
func (r *run) recoverRecreatedTopic(topic string) {
	r.logger.Error("topic was deleted and re-created; purging it from the client and consuming the new topic",
		"group", r.cfg.Group, "topic", topic)
	r.client.PurgeTopicsFromClient(topic)
	r.client.AddConsumeTopics(topic)
}

// arm makes cancel the poll's hurry; a rebalance that signalled while no
// poll was armed cancels it at once.
func (r *run) arm(cancel context.CancelCauseFunc) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hurry = cancel
	if r.pending {
		cancel(errRebalancePending)
	}
}

func (r *run) disarm() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hurry, r.pending = nil, false
}

// onBlocked is kgo's signal that a rebalance (assign, revoke or loss) is
// waiting for the poll being processed: end its waits now.
func (r *run) onBlocked(context.Context, *kgo.Client) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pending = true
	if r.hurry != nil {
		r.hurry(errRebalancePending)
	}
}

func (r *run) onAssigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	r.logger.Info("partitions assigned", "group", r.cfg.Group, "partitions", fmt.Sprint(assigned))
}

// onRevoked commits what is marked before the partitions go to another
// member. It runs between polls (BlockRebalanceOnPoll), so every marked
// offset belongs to a committed transaction.
func (r *run) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	r.logger.Info("partitions revoked", "group", r.cfg.Group, "partitions", fmt.Sprint(revoked))
	if err := cl.CommitMarkedOffsets(ctx); err != nil {
		r.logger.Warn("commit on revoke failed; the new owner re-reads from the last commit and skips duplicates",
			"group", r.cfg.Group, "partitions", fmt.Sprint(revoked), "err", err)
	}
}

// onLost: the partitions are gone without a chance to commit (session
// expired); their marks are dropped by kgo and the new owner re-reads from
// the last commit, skipping duplicates.
func (r *run) onLost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	r.logger.Warn("partitions lost", "group", r.cfg.Group, "partitions", fmt.Sprint(lost))
}

// processPartition applies one partition's records in order, marking each
// chunk's offset after every handler is done with it. When ctx is cancelled
// (shutdown, or a rebalance waiting) it stops and returns the first record
// not done, which is not marked and must be fetched again; nil when every
// record is done.
//
// *pending is kept at the first record not marked (nil once all are).
func (r *run) processPartition(ctx context.Context, recs []*kgo.Record, pending **kgo.Record) *kgo.Record {
	for start := 0; start < len(recs); start += r.cfg.BatchSize {
		chunk := recs[start:min(start+r.cfg.BatchSize, len(recs))]
		irecs := make([]*idem.Record, len(chunk))
		for i, rec := range chunk {
			irecs[i] = toRecord(rec)
		}
		done := len(chunk) // records of the chunk every handler is done with
		handlers := r.byTopic[chunk[0].Topic]
		for i, h := range handlers {
			outcomes, err := r.proc.ProcessBatch(ctx, h, irecs)
			if r.cfg.OnRecord != nil {
				for j, o := range outcomes {
					r.cfg.OnRecord(h, irecs[j], o)
				}
			}
			if err != nil {
				done = min(done, len(outcomes))
				if i < len(handlers)-1 {
					done = 0 // the handlers after this one have not seen the chunk
				}
				break
			}
		}
		if done < len(chunk) {
			if done > 0 {
				r.client.MarkCommitRecords(chunk[done-1])
			}
			*pending = chunk[done]
			return chunk[done]
		}
		crash.Point(ctx, "consume.after-commit")
		r.client.MarkCommitRecords(chunk[len(chunk)-1])
		*pending = nil
		if end := start + len(chunk); end < len(recs) {
			*pending = recs[end]
		}
	}
	return nil
}

func (r *run) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.client.CommitMarkedOffsets(ctx); err != nil {
		r.logger.Warn("final offset commit failed; the next owner skips the duplicates", "group", r.cfg.Group, "err", err)
	}
	r.client.CloseAllowingRebalance()
}

func toRecord(r *kgo.Record) *idem.Record {
	rec := &idem.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value}
	for _, h := range r.Headers {
		rec.Headers = append(rec.Headers, idem.RecordHeader{Key: h.Key, Value: h.Value})
	}
	return rec
}
